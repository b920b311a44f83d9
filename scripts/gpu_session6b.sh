#!/usr/bin/env bash
# Device call on 1 GPU (issue 23), after scripts/gpu_session6.sh: the step suite with the compiled and captured rows
# (plain_compiled(_ro), plain_captured, cat_captured, gs_*_captured) beside the eager ones; ratios against the
# compiled plain step: python scripts/paired_summary.py step.json. Results survive a time-out (CAT_FAST_BENCH_JSONL).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false CAT_FAST_BENCH_JSONL="$OUT/step.jsonl"
# the rows issue 23's targets compare, 64x256 first
step_rows 420 "64x256 8x128 32x128" "plain_compiled_ro plain_compiled plain_training_layers plain_captured \
  plain_fast_captured cat cat_captured gs_first_order_fwd gs_first_order_fwd_captured gs_pooled gs_pooled_captured"
