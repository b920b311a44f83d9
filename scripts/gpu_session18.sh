#!/usr/bin/env bash
# Device call on 1 GPU (issue 23): with FUSED_MIN_ROWS = 1024, (1) the fast layers' GPU tests; (2) the step suite at
# 8x128 (now the fused path) beside the compiled plain step; (3) the fast plain step's and CAT's kernels at 64x256
# with the mixing layer fixed to 9 (kernels.tgz), for what is left at that size.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 100 python3 -m pytest tests/layers tests/kernels -q -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "rc=$?" >> "$OUT/tests.log"; grep -E "passed|failed|FAILED|rc=" "$OUT/tests.log" | tail -8
step_rows 130 "8x128" "plain_compiled_ro plain_fast_captured cat_captured gs_pooled_captured gs_first_order_fwd_captured"
timeout 90 python3 benchmarks/tools/profile_step.py --size 64x256 --steps 3 --cat-layer 9 --dump "$OUT/kernels" \
  plain_fast_captured cat_captured > "$OUT/diag.txt" 2>&1
grep -E "^== |by kind" "$OUT/diag.txt"
tar czf "$OUT/kernels.tgz" -C "$OUT" kernels && rm -rf "$OUT/kernels" "$OUT/build.log"
