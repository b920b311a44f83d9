#!/usr/bin/env bash
# Device run: CUDA build, GPU tests (ops on cuda + triton, CUDA-graph CAT, training API, GS), kernel-only cmix
# timings (with their float64 check), then the benchmark suite and its report. Few files under $OUT (only a
# handful come back). Switches (default on / all): GPU_OP_TESTS=0 skips the op tests, KERNEL_ONLY=0 the
# kernel-only timings, BENCH_SUBSET=ops|step|none picks the benchmarks (benchmarks/ops, benchmarks/steps; the raw
# results and report land in $OUT, see benchmarks/run_gpu.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
if [ "${GPU_OP_TESTS:-1}" = 1 ]; then
  timeout 200 python3 -m pytest tests/ops tests/test_backends.py -q -p no:cacheprovider -k "cuda or triton" -rf \
    >"$OUT/gpu_tests.txt" 2>&1
  echo "op tests on GPU: rc=$? $(tail -1 "$OUT/gpu_tests.txt")"
fi
timeout 150 python3 -m pytest tests/objectives/test_cat_graphs.py tests/integrations/test_gpu_training.py \
  tests/objectives/test_gs.py tests/objectives/test_cat.py tests/models/test_models.py tests/layers/test_resumed.py \
  tests/kernels/test_residual_layer_norm.py tests/kernels/test_pooled_gs_loss.py tests/layers/test_training.py \
  -q -p no:cacheprovider -rf >>"$OUT/gpu_tests.txt" 2>&1
echo "training API on GPU: rc=$? $(tail -1 "$OUT/gpu_tests.txt")"
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.txt" | head -20
if [ "${KERNEL_ONLY:-1}" = 1 ]; then
  timeout 60 python3 benchmarks/tools/kernel_only.py >"$OUT/kernel_only.txt" 2>&1; echo "kernel_only rc=$?"
  head -16 "$OUT/kernel_only.txt"
fi
SUBSET=${BENCH_SUBSET:-all}
if [ "$SUBSET" != none ]; then
  BENCH_BUDGET_S=${BENCH_BUDGET_S:-320} BENCH_OPS_BUDGET_S=${BENCH_OPS_BUDGET_S:-170} OUT="$OUT" \
    bash benchmarks/run_gpu.sh "$SUBSET" > "$OUT/bench_stdout.log" 2>&1
  echo "bench rc=$?"; grep -E "passed|failed|exit" "$OUT/bench_stdout.log" | tail -3
fi
rm -f "$OUT/bench.jsonl" "$OUT/build.log" "$OUT/env.txt" "$OUT/pytest.log"
