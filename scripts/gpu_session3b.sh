#!/usr/bin/env bash
# Device call B of 2026-11-27 (2 GPUs): the whole BERT-base bf16 sweep on one GPU (GPU 0) beside the GPU tests and the
# MiniLM fp32 sweep on GPU 1; then the MiniLM fp32 sweep on both GPUs (torchrun), compared with the one-GPU result.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
T=benchmarks/tools/mediation_sweep_time.py
(
  CUDA_VISIBLE_DEVICES=0 timeout 480 python3 $T --model bert-base --precision bf16 --save "$OUT/bert-bf16-1gpu.pt" \
    --out "$OUT/sweeps.jsonl" > "$OUT/bert-1gpu.log" 2>&1; echo "bert rc=$?" >> "$OUT/bert-1gpu.log"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/analysis/test_mediation.py -k "gpu or cuda" \
    tests/ops/test_sample_characteristics.py tests/ops/test_bias_losses.py -rfEs > "$OUT/gpu-tests.txt" 2>&1
  echo "tests rc=$?" >> "$OUT/gpu-tests.txt"
  timeout 120 python3 $T --model minilm --precision fp32 --save "$OUT/minilm-fp32-1gpu.pt" --out "$OUT/sweeps.jsonl" \
    > "$OUT/minilm-1gpu.log" 2>&1; echo "minilm rc=$?" >> "$OUT/minilm-1gpu.log"
) &
wait
timeout 90 torchrun --standalone --nproc_per_node 2 $T --model minilm --precision fp32 --compare \
  "$OUT/minilm-fp32-1gpu.pt" --out "$OUT/sweeps.jsonl" > "$OUT/minilm-2gpu.log" 2>&1
echo "minilm 2gpu rc=$?" >> "$OUT/minilm-2gpu.log"
tail -3 "$OUT/gpu-tests.txt"; tail -2 "$OUT"/*.log; cat "$OUT/sweeps.jsonl"
