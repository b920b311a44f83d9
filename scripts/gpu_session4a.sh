#!/usr/bin/env bash
# Device call A of 2026-11-27 #2 (2 GPUs), issue 21: why CAT scales 1.49x on 2 GPUs.
#   1. the NCCL test (CAT's CUDA graphs inside DDP, ranks bit-identical);
#   2. ddp_step_bench on 1 GPU and on 2 (DDP, and without DDP: the ceiling), with per-rank profiles;
#   3. cat-fast train under torchrun on 2 GPUs against 1 GPU at the same global batch (MiniLM, CAD NLI, CAT).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
L="$OUT/logs"; mkdir -p "$L" /tmp/prof
timeout 240 python3 -m pytest tests/test_distributed.py -q -p no:cacheprovider -k gpu -rs > "$L/nccl-test.log" 2>&1
echo "rc=$?" >> "$L/nccl-test.log"; tail -3 "$L/nccl-test.log"
B=benchmarks/tools/ddp_step_bench.py
J="$OUT/ddp.jsonl"
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 $B --methods erm cat cat-eager gs --profile /tmp/prof 2>"$L/ddp-1.err" | tee -a "$J"
timeout 200 torchrun --standalone --nproc_per_node 2 $B --methods erm cat cat-eager gs --profile /tmp/prof \
  2>"$L/ddp-2.err" | tee -a "$J"
timeout 120 torchrun --standalone --nproc_per_node 2 $B --methods erm cat --no-ddp 2>"$L/ddp-2n.err" | tee -a "$J"
W=/tmp/runs; mkdir -p $W
T="--task nli --method cat --epochs 2 --bf16 --seed 0 --no-checkpoint"
s=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m cat_fast.cli train $T --batch-size 32 --out $W/one > "$L/train-1gpu.log" 2>&1
echo "rc=$? wall=$(( $(date +%s) - s ))s" >> "$L/train-1gpu.log"
s=$(date +%s)
timeout 200 torchrun --standalone --nproc_per_node 2 -m cat_fast.cli train $T --batch-size 16 --out $W/two \
  > "$L/train-2gpu.log" 2>&1
echo "rc=$? wall=$(( $(date +%s) - s ))s" >> "$L/train-2gpu.log"
cp $W/one/metrics.json "$L/train-1gpu-metrics.json" 2>/dev/null; cp $W/two/metrics.json "$L/train-2gpu-metrics.json" 2>/dev/null
ls -la $W/two >> "$L/train-2gpu.log"
tail -4 "$L/train-1gpu.log" "$L/train-2gpu.log"
cp -r /tmp/prof "$L/prof"
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
