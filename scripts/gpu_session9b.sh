#!/usr/bin/env bash
# Device call on 1 GPU (issue 23), on the machine warm from gpu_session9.sh (the build is then incremental): the
# step suite's rows against the reduce-overhead-compiled plain step, with the training layer's fused kernels,
# 64x256 and 32x128 first.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false CAT_FAST_BENCH_JSONL="$OUT/step.jsonl"
step_rows 400 "64x256 32x128 8x128" \
  "plain_compiled_ro plain_fast_captured cat_captured gs_pooled_captured gs_first_order_fwd_captured"
