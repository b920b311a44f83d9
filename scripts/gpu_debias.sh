#!/usr/bin/env bash
# Device run for the bias-model losses: CUDA build, their GPU tests (cuda + triton, with crm_loss, whose completion
# counter they share, and the CUDA-graph CAT tests that use it), then their op benchmarks and the debiased step rows
# beside the plain steps. Results in $OUT (bench.json, RESULTS.md from benchmarks/report.py).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
timeout 240 python3 -m pytest tests/ops/test_bias_losses.py tests/ops/test_crm_loss.py tests/ops/test_compile.py \
  tests/test_backends.py -q -p no:cacheprovider -k "cuda or triton" -rf >"$OUT/gpu_tests.txt" 2>&1
echo "op tests on GPU: rc=$? $(tail -1 "$OUT/gpu_tests.txt")"
timeout 120 python3 -m pytest tests/objectives/test_debias.py tests/objectives/test_cat_graphs.py -q -p no:cacheprovider \
  -rf >>"$OUT/gpu_tests.txt" 2>&1
echo "objective tests on GPU: rc=$? $(tail -1 "$OUT/gpu_tests.txt")"
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.txt" | head -20
start=$(date +%s)
export CAT_FAST_BENCH_JSONL="$OUT/bench.jsonl" CAT_FAST_BENCH_DEADLINE_OPS=$((start + ${OPS_S:-110})) \
  CAT_FAST_BENCH_DEADLINE_STEP=$((start + ${BENCH_S:-330} - 20))
timeout -s INT -k 20 "${BENCH_S:-330}" python3 -m pytest benchmarks/ops/test_bench_bias_loss.py \
  benchmarks/steps/test_bench_step.py -q -p no:cacheprovider -rfE \
  -k "(bias_loss and (-64x3- or 1048576x3)) or (test_step and (plain or poe or reweight or learned_mixin or conf_reg))" \
  --benchmark-json "$OUT/bench.json" >"$OUT/bench_pytest.log" 2>&1
echo "bench rc=$? after $(( $(date +%s) - start ))s: $(tail -1 "$OUT/bench_pytest.log")"
python3 benchmarks/report.py "$OUT/bench.json" "$OUT/bench.jsonl" --out "$OUT/RESULTS.md" >/dev/null 2>&1
echo "report rc=$?"
