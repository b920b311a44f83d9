#!/usr/bin/env bash
# Device run: build with CUDA, the op suite on CUDA (cuda + triton backends, fp32/bf16), GPU paths of the
# training API, then the benchmark suite. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
timeout 150 python3 -m pytest tests/ops tests/test_backends.py -q -p no:cacheprovider -k "cuda or triton" >"$OUT/gpu_tests.log" 2>&1
echo "op tests on GPU: rc=$? $(tail -1 "$OUT/gpu_tests.log")"
timeout 120 python3 -m pytest tests/test_gpu_training.py -q -p no:cacheprovider >"$OUT/gpu_training.log" 2>&1
echo "training API on GPU: rc=$? $(tail -1 "$OUT/gpu_training.log")"
BENCH_BUDGET_S=${BENCH_BUDGET_S:-300} OUT="$OUT" bash benchmarks/run_gpu.sh "${1:-all}" > "$OUT/bench_stdout.log" 2>&1
echo "bench rc=$?"; tail -60 "$OUT/bench_stdout.log"
