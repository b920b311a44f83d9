#!/usr/bin/env bash
# Device call on 1 GPU (issue 23): the boolean attention mask converted once per step (casts.additive_mask,
# layout.sdpa_mask) instead of inside every SDPA call of the fast layers. (1) GPU tests: fast layers, models, the
# step, ERM, CAT, GS (tests.log); (2) the compiled plain step and CAT captured at 8x128, 32x128 and 64x256 (step.json)
# and CAT with the mask handed to SDPA as before (step-off.json, the same machine); both summaries in summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 170 python3 -m pytest tests/layers tests/models tests/test_step.py tests/objectives/test_erm.py \
  tests/objectives/test_cat.py tests/objectives/test_gs.py -q -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "rc=$?" >> "$OUT/tests.log"; grep -E "passed|failed|FAILED|rc=" "$OUT/tests.log" | tail -12
step_rows 200 "8x128 32x128 64x256" "plain_compiled_ro cat_captured"
ids=("benchmarks/steps/test_bench_step.py::test_step[32x128-cat_captured]"
     "benchmarks/steps/test_bench_step.py::test_step[64x256-cat_captured]")
timeout 100 python3 -c "import sys, pytest, torch, cat_fast.layers.training as t, cat_fast.layers.resumed as r; \
t.sdpa_mask = r.sdpa_mask = lambda m, d: m if m is None or m.dtype == torch.bool else m.to(d); \
sys.exit(pytest.main(sys.argv[1:]))" "${ids[@]}" -q -p no:cacheprovider --benchmark-json "$OUT/step-off.json" \
  > "$OUT/diag.txt" 2>&1; echo "rc=$?" >> "$OUT/diag.txt"
python3 scripts/paired_summary.py "$OUT/step-off.json" | sed 's/^== /== (mask converted by SDPA) /' \
  | tee -a "$OUT/summary.txt"
rm -f "$OUT/build.log"
