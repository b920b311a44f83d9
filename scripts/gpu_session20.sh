#!/usr/bin/env bash
# Device call on 1 GPU (issue 23): the first-token layer's attention as fused Triton kernels
# (layers.attention.first_row; kernels.triton.first_row_attention) and INPUT_ONLY_KEY_VALUE on by default:
# (1) GPU tests of the layers, models, CAT and the step; (2) the attention forward + backward beside SDPA, the eager
# and the compiled composition, with a tile/warp sweep (attention.txt); (3) CAT captured at 32x128 and 64x256 beside
# the compiled plain step with the kernels (step.json) and without them (step-off.json, the same machine; both
# summaries in summary.txt); (4) CAT's kernels at 64x256, m = 9 (kernels.tgz).
# At most 8 files come back: gpu.txt, tests.log, attention.txt, step.json, summary.txt, step-off.json, diag.txt,
# kernels.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 170 python3 -m pytest tests/layers tests/models tests/objectives/test_cat.py tests/test_step.py -q \
  -p no:cacheprovider > "$OUT/tests.log" 2>&1; echo "rc=$?" >> "$OUT/tests.log"
grep -E "passed|failed|FAILED|rc=" "$OUT/tests.log" | tail -12
timeout 150 python3 benchmarks/tools/first_row_attention.py --sweep > "$OUT/attention.txt" 2>&1
echo "rc=$?" >> "$OUT/attention.txt"; cat "$OUT/attention.txt" | grep -v "^    BLOCK"
step_rows 150 "32x128 64x256" "plain_compiled_ro cat_captured"
ids=("benchmarks/steps/test_bench_step.py::test_step[32x128-cat_captured]"
     "benchmarks/steps/test_bench_step.py::test_step[64x256-cat_captured]")
timeout 100 python3 -c "import sys, pytest, cat_fast.layers.attention as a; a.FUSED = False; \
sys.exit(pytest.main(sys.argv[1:]))" "${ids[@]}" -q -p no:cacheprovider --benchmark-json "$OUT/step-off.json" \
  > "$OUT/diag.txt" 2>&1; echo "rc=$?" >> "$OUT/diag.txt"
python3 scripts/paired_summary.py "$OUT/step-off.json" | sed 's/^== /== (attention kernels off) /' \
  | tee -a "$OUT/summary.txt"
timeout 60 python3 benchmarks/tools/profile_step.py --size 64x256 --cat-layer 9 --dump "$OUT/kernels" cat_captured \
  >> "$OUT/diag.txt" 2>&1
grep -E "^== |by kind|first_row|_forward_kernel|_backward_kernel|fmha|efficient" "$OUT/diag.txt" | head -20
tar czf "$OUT/kernels.tgz" -C "$OUT" kernels && rm -rf "$OUT/kernels" "$OUT/build.log" "$OUT/step.log"
