#!/usr/bin/env bash
# Final device run: CUDA build, every GPU test (ops on cuda + triton, CUDA-graph CAT, training API, GS),
# kernel-only cmix timings (with their float64 check), then the whole benchmark suite and its report.
# Few files under $OUT (only a handful come back).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
timeout 200 python3 -m pytest tests/ops tests/test_backends.py -q -p no:cacheprovider -k "cuda or triton" -rf \
  >"$OUT/gpu_tests.txt" 2>&1
echo "op tests on GPU: rc=$? $(tail -1 "$OUT/gpu_tests.txt")"
timeout 120 python3 -m pytest tests/test_cal_graph.py tests/test_gpu_training.py tests/test_gs.py -q -p no:cacheprovider \
  -rf >>"$OUT/gpu_tests.txt" 2>&1
echo "training API on GPU: rc=$? $(tail -1 "$OUT/gpu_tests.txt")"
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.txt" | head -20
timeout 60 python3 benchmarks/kernel_only.py >"$OUT/kernel_only.txt" 2>&1; echo "kernel_only rc=$?"; head -16 "$OUT/kernel_only.txt"
BENCH_BUDGET_S=${BENCH_BUDGET_S:-320} BENCH_OPS_BUDGET_S=${BENCH_OPS_BUDGET_S:-170} OUT="$OUT" bash benchmarks/run_gpu.sh all \
  > "$OUT/bench_stdout.log" 2>&1
echo "bench rc=$?"; grep -E "passed|failed|exit" "$OUT/bench_stdout.log" | tail -3
rm -f "$OUT/bench.jsonl" "$OUT/build.log" "$OUT/env.txt" "$OUT/pytest.log"
