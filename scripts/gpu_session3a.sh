#!/usr/bin/env bash
# Device call A of 2026-11-27 (2 GPUs): GPU tests + CLP step rows on GPU 0, the mediation timing on GPU 1, side by side.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/analysis tests/objectives/test_clp.py \
    tests/ops/test_sample_characteristics.py tests/ops/test_bias_losses.py -rfEs > "$OUT/gpu-tests.txt" 2>&1
  echo "tests rc=$?" >> "$OUT/gpu-tests.txt"
  CAT_FAST_BENCH_DEADLINE_STEP=$(( $(date +%s) + 200 )) timeout 230 python3 -m pytest benchmarks/steps/test_bench_step.py \
    -q -p no:cacheprovider -k "test_step and (plain or clp) and not first_token and not training_layers and not 512" \
    --benchmark-json "$OUT/step-clp.json" > "$OUT/step-clp.log" 2>&1
  echo "step rc=$?" >> "$OUT/step-clp.log"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 420 python3 benchmarks/tools/mediation_bench.py --models minilm bert-base --bert-layers 10 11 \
    --looped-neurons 48 --out "$OUT/mediation-timing.json" > "$OUT/mediation-timing.log" 2>&1
  echo "mediation rc=$?" >> "$OUT/mediation-timing.log"
) &
wait
tail -5 "$OUT/gpu-tests.txt"; tail -3 "$OUT/step-clp.log"; tail -8 "$OUT/mediation-timing.log"
