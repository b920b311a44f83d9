#!/usr/bin/env bash
# Device call on 1 GPU (issue 23), after gpu_session14.sh's sweep chose the row-sum kernels' launch settings:
# (1) GPU tests of the kernels, the fast layers, the captured step, ERM, CAT and the step-graph integration;
# (2) one training layer fused / unfused at 8x128 and 32x128 (the FUSED_MIN_ROWS threshold); (3) the step suite at
# 32x128 and 64x256 beside the compiled plain step; (4) the fast plain step's and CAT's kernels at 32x128 with the
# mixing layer fixed to 9 (kernels.tgz: one TSV per method).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false CAT_FAST_BENCH_JSONL="$OUT/step.jsonl"
timeout 170 python3 -m pytest tests/kernels tests/layers tests/test_step.py tests/objectives/test_erm.py \
  tests/objectives/test_cat.py tests/integrations/test_step_graphs.py -q -p no:cacheprovider \
  > "$OUT/tests.log" 2>&1; echo "rc=$?" >> "$OUT/tests.log"
grep -E "passed|failed|FAILED|rc=" "$OUT/tests.log" | tail -8
timeout 60 python3 benchmarks/tools/training_layer_host.py --sizes 8x128 32x128 --calls 15 > "$OUT/diag.txt" 2>&1
step_rows 200 "32x128 64x256" "plain_compiled_ro plain_fast_captured cat_captured"
timeout 90 python3 benchmarks/tools/profile_step.py --size 32x128 --steps 3 --cat-layer 9 --dump "$OUT/kernels" \
  plain_fast_captured cat_captured >> "$OUT/diag.txt" 2>&1
grep -vi warn "$OUT/diag.txt" | grep -E "^ *(own|unfused|training|size|==|  *by kind)|ms" | head -40
tar czf "$OUT/kernels.tgz" -C "$OUT" kernels && rm -rf "$OUT/kernels" "$OUT/build.log" "$OUT/step.jsonl"
