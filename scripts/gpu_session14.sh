#!/usr/bin/env bash
# Device call on 1 GPU (issue 23): (1) GPU tests of the kernels (the row-sum kernels' tiles and launch settings,
# column_sums), the fast layers (shared 16-bit weight copies, the resumed layer's one QKV matmul), the captured
# step and CAT; (2) the row-sum kernels' launch settings against eager and torch.compile (row_kernels.py);
# (3) the step suite at 32x128 and 64x256 beside the compiled plain step.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false CAT_FAST_BENCH_JSONL="$OUT/step.jsonl"
timeout 150 python3 -m pytest tests/kernels tests/layers tests/test_step.py tests/objectives/test_erm.py \
  tests/objectives/test_cat.py -q -p no:cacheprovider -x > "$OUT/tests.log" 2>&1; echo "rc=$?" >> "$OUT/tests.log"
grep -E "passed|failed|FAILED|Error|rc=" "$OUT/tests.log" | tail -8
timeout 170 python3 benchmarks/tools/row_kernels.py > "$OUT/row_kernels.txt" 2>&1; echo "rc=$?" >> "$OUT/row_kernels.txt"
tail -3 "$OUT/row_kernels.txt"
step_rows 200 "32x128 64x256" "plain_compiled_ro plain_fast_captured cat_captured"
