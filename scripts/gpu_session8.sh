#!/usr/bin/env bash
# Device call on 1 GPU (issue 23), next session: (1) the GPU tests not yet run on this code - the CUDA crm_loss
# kernel with NaN inputs (csrc/cuda/common.cuh's softmax state), the NaN op tests of every GPU backend, ERM(fast=True)
# replayed by CapturedStep; (2) the step suite's plain_fast_captured row (cat_fast's fast plain step as one graph)
# beside the compiled plain step and the captured CAT / plain rows, 64x256 first.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false CAT_FAST_BENCH_JSONL="$OUT/step.jsonl"
timeout 150 python3 -m pytest tests/ops/test_crm_loss.py tests/ops/test_cal_objective.py tests/ops/test_cal_step.py \
  tests/ops/test_bias_losses.py tests/ops/test_nan.py -q -p no:cacheprovider -k "cuda and (nan or matches_reference)" > "$OUT/ops.log" 2>&1
echo "rc=$?" >> "$OUT/ops.log"; grep -E "passed|failed|FAILED|rc=" "$OUT/ops.log" | tail -12
timeout 90 python3 -m pytest tests/test_step.py tests/objectives/test_erm.py -q -p no:cacheprovider -k "erm" \
  > "$OUT/tests.log" 2>&1; echo "rc=$?" >> "$OUT/tests.log"; grep -E "passed|failed|FAILED|rc=" "$OUT/tests.log" | tail -8
timeout 60 python3 scripts/check_cache_test_power.py > "$OUT/power.log" 2>&1; echo "rc=$?" >> "$OUT/power.log"
grep -E "power check|rc=" "$OUT/power.log"
step_rows 240 "64x256 32x128 8x128" "plain_compiled_ro plain_fast_captured plain_captured cat_captured"
