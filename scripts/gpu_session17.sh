#!/usr/bin/env bash
# Device call on 1 GPU (issue 23), the session's closing measurement: (1) GPU tests (kernels, fast layers, models,
# captured step, ERM, CAT, GS, step-graph integration); (2) the step suite at 8x128, 32x128 and 64x256: the compiled
# plain step, the fast plain step, CAT, GS pooled and GS first-order, captured; (3) the fast plain step and CAT at
# 8x128 with the fused training layer at every size (FUSED_MIN_ROWS = 0, step-0.json), for the threshold.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 160 python3 -m pytest tests/kernels tests/layers tests/models tests/test_step.py tests/objectives/test_erm.py \
  tests/objectives/test_cat.py tests/objectives/test_gs.py tests/integrations/test_step_graphs.py -q \
  -p no:cacheprovider > "$OUT/tests.log" 2>&1; echo "rc=$?" >> "$OUT/tests.log"
grep -E "passed|failed|FAILED|rc=" "$OUT/tests.log" | tail -8
step_rows 250 "8x128 32x128 64x256" \
  "plain_compiled_ro plain_fast_captured cat_captured gs_pooled_captured gs_first_order_fwd_captured"
ids=("benchmarks/steps/test_bench_step.py::test_step[8x128-plain_fast_captured]"
     "benchmarks/steps/test_bench_step.py::test_step[8x128-cat_captured]")
timeout 80 python3 -c "import sys, pytest, cat_fast.layers.training as t; t.FUSED_MIN_ROWS = 0; \
sys.exit(pytest.main(sys.argv[1:]))" "${ids[@]}" -q -p no:cacheprovider --benchmark-json "$OUT/step-0.json" \
  > "$OUT/step-0.log" 2>&1; echo "rc=$?" >> "$OUT/step-0.log"
python3 scripts/paired_summary.py "$OUT/step-0.json" | tee "$OUT/summary-0.txt"
rm -f "$OUT/build.log"
