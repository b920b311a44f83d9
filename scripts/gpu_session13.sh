#!/usr/bin/env bash
# Device call on 1 GPU (issue 23): (1) the kernel and training-layer GPU tests after the residual_layer_norm refactor
# (one row's backward as a shared jit helper) and the FUSED_MIN_ROWS threshold; (2) where the GPU time of the fast
# plain step and of CAT goes at 32x128 and 64x256 against the compiled plain step, every kernel dumped
# (profile_step.py --dump); (3) the step suite at 8x128 (the threshold's unfused path) beside the compiled step.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false CAT_FAST_BENCH_JSONL="$OUT/step.jsonl"
timeout 150 python3 -m pytest tests/kernels/test_residual_layer_norm.py tests/kernels/test_gelu_bias_backward.py \
  tests/layers/test_training.py tests/layers/test_resumed.py tests/objectives/test_erm.py -q -p no:cacheprovider \
  > "$OUT/tests.log" 2>&1; echo "rc=$?" >> "$OUT/tests.log"; grep -E "passed|failed|FAILED|rc=" "$OUT/tests.log" | tail -8
for size in 32x128 64x256; do
  timeout 150 python3 benchmarks/tools/profile_step.py --size $size --steps 3 --dump "$OUT/kernels" \
    plain_compiled_ro plain_fast_captured cat_captured > "$OUT/profile-$size.txt" 2>&1
  echo "rc=$?" >> "$OUT/profile-$size.txt"; grep -E "^== |by kind|rc=" "$OUT/profile-$size.txt"
done
step_rows 150 "8x128" "plain_compiled_ro plain_fast_captured cat_captured gs_pooled_captured"
