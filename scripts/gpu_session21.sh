#!/usr/bin/env bash
# Device call on 1 GPU (issue 23), after gpu_session20.sh: the first-row attention kernels with float64 scalars in
# two halves, the tests' upstream gradient drawn in float64 and the timing tool's leaves made inside the capture.
# (1) GPU tests: kernels, fast layers, models, the step, ERM, CAT, GS, step graphs (tests.log); (2) the attention
# forward + backward beside SDPA and the eager / compiled composition, with a tile / warp sweep (attention.txt);
# (3) CAT's kernels at 64x256, m = 9 (kernels.tgz, diag.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 170 python3 -m pytest tests/kernels tests/layers tests/models tests/test_step.py tests/objectives/test_erm.py \
  tests/objectives/test_cat.py tests/objectives/test_gs.py tests/integrations/test_step_graphs.py -q \
  -p no:cacheprovider > "$OUT/tests.log" 2>&1; echo "rc=$?" >> "$OUT/tests.log"
grep -E "passed|failed|FAILED|rc=" "$OUT/tests.log" | tail -12
timeout 200 python3 benchmarks/tools/first_row_attention.py --sweep > "$OUT/attention.txt" 2>&1
echo "rc=$?" >> "$OUT/attention.txt"; grep -v "^    BLOCK" "$OUT/attention.txt" | tail -40
timeout 70 python3 benchmarks/tools/profile_step.py --size 64x256 --cat-layer 9 --dump "$OUT/kernels" cat_captured \
  > "$OUT/diag.txt" 2>&1
grep -E "^== |by kind" "$OUT/diag.txt"
tar czf "$OUT/kernels.tgz" -C "$OUT" kernels && rm -rf "$OUT/kernels" "$OUT/build.log"
