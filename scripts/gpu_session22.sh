#!/usr/bin/env bash
# Device call on 1 GPU (issue 23), the closing measurement of the first-row attention kernels: the step suite at
# 8x128, 32x128 and 64x256 (the compiled plain step, the fast plain step, CAT, GS pooled and GS first-order,
# captured: step.json), and CAT with the kernels off on the same machine (step-off.json); both summaries in
# summary.txt. First the attention and first-token tests again (the kernels' shared prologue, 128-key tiles:
# tests.log) and the attention timings with those tiles (attention.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 60 python3 -m pytest tests/layers/test_attention.py tests/layers/test_first_token.py -q -p no:cacheprovider \
  > "$OUT/tests.log" 2>&1; echo "rc=$?" >> "$OUT/tests.log"
grep -E "passed|failed|FAILED|rc=" "$OUT/tests.log" | tail -8
timeout 50 python3 benchmarks/tools/first_row_attention.py > "$OUT/attention.txt" 2>&1
echo "rc=$?" >> "$OUT/attention.txt"; cat "$OUT/attention.txt"
step_rows 280 "8x128 32x128 64x256" \
  "plain_compiled_ro plain_fast_captured cat_captured gs_pooled_captured gs_first_order_fwd_captured"
ids=("benchmarks/steps/test_bench_step.py::test_step[32x128-cat_captured]"
     "benchmarks/steps/test_bench_step.py::test_step[64x256-cat_captured]")
timeout 100 python3 -c "import sys, pytest, cat_fast.layers.attention as a; a.FUSED = False; \
sys.exit(pytest.main(sys.argv[1:]))" "${ids[@]}" -q -p no:cacheprovider --benchmark-json "$OUT/step-off.json" \
  > "$OUT/diag.txt" 2>&1; echo "rc=$?" >> "$OUT/diag.txt"
python3 scripts/paired_summary.py "$OUT/step-off.json" | sed 's/^== /== (attention kernels off) /' \
  | tee -a "$OUT/summary.txt"
rm -f "$OUT/build.log"
