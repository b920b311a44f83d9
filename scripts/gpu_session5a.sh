#!/usr/bin/env bash
# Prepared for the next device call (2 GPUs), issue 21 after runs AQ/AR: does limiting NCCL's CTAs or enlarging
# DDP's buckets stop the all-reduce kernels from slowing the backward (RESULTS.md, "Several GPUs")? 60 timed steps
# per case, 1 GPU then 2 GPUs; then CAT through cat-fast train under torchrun on 2 GPUs (no warm-up epoch).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
B=benchmarks/tools/ddp_step_bench.py
J="$OUT/ddp.jsonl"
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 $B --methods erm cat gs --steps 60 2>"$OUT/ddp-1.err" | tee -a "$J"
timeout 120 torchrun --standalone --nproc_per_node 2 $B --methods erm cat gs --steps 60 2>>"$OUT/ddp-2.err" | tee -a "$J"
for ctas in 4 8 16; do
  NCCL_MAX_CTAS=$ctas timeout 120 torchrun --standalone --nproc_per_node 2 $B --methods erm cat gs --steps 60 \
    2>>"$OUT/ddp-2.err" | tee -a "$J"
done
timeout 120 torchrun --standalone --nproc_per_node 2 $B --methods erm cat gs --steps 60 --bucket-mb 200 \
  2>>"$OUT/ddp-2.err" | tee -a "$J"
T="--task nli --method cat --epochs 1 --warmup-epochs 0 --bf16 --seed 0 --no-checkpoint"
s=$(date +%s)
timeout 150 torchrun --standalone --nproc_per_node 2 -m cat_fast.cli train $T --batch-size 16 --out /tmp/two \
  > "$OUT/train-2gpu.log" 2>&1; echo "rc=$? wall=$(( $(date +%s) - s ))s" | tee -a "$OUT/train-2gpu.log"
grep -h "wrote\|warning" "$OUT/train-2gpu.log" | head -5; cp /tmp/two/metrics.json "$OUT/train-2gpu-metrics.json"
