#!/usr/bin/env bash
# Device call on 1 GPU (issue 23), the session's last: the GPU tests of the fast layers, models, CAT, GS, ERM and
# the captured step on the final code (casts' shared-entry helper, the first-row kernels' names and empty-batch
# check, the step suite's new rows untouched by tests) (tests.log).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 300 python3 -m pytest tests/layers tests/models tests/test_step.py tests/objectives/test_erm.py \
  tests/objectives/test_cat.py tests/objectives/test_gs.py -q -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "rc=$?" >> "$OUT/tests.log"; grep -E "passed|failed|FAILED|rc=" "$OUT/tests.log" | tail -12
rm -f "$OUT/build.log"
