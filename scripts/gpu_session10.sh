#!/usr/bin/env bash
# Device call on 2 GPUs (issue 21), the short version of gpu_session5a.sh for the device time left: CAT through
# cat-fast train under torchrun on 2 GPUs (no warm-up epoch, so the run trains CAT) and the same on 1 GPU; then
# ddp_step_bench (ERM, CAT; 40 timed steps) on 1 GPU, on 2, with NCCL_MAX_CTAS=8, and with 200 MiB buckets.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
T="--task nli --method cat --epochs 1 --warmup-epochs 0 --bf16 --seed 0 --no-checkpoint"
for n in 2 1; do
  s=$(date +%s)
  timeout 110 torchrun --standalone --nproc_per_node $n -m cat_fast.cli train $T --batch-size $(( 32 / n )) \
    --out /tmp/run$n > "$OUT/train-${n}gpu.log" 2>&1
  echo "rc=$? wall=$(( $(date +%s) - s ))s" | tee -a "$OUT/train-${n}gpu.log"
  grep -h "dev\|wrote\|Warning\|Error" "$OUT/train-${n}gpu.log" | tail -4; cp /tmp/run$n/metrics.json "$OUT/train-${n}gpu-metrics.json"
done
B=benchmarks/tools/ddp_step_bench.py
J="$OUT/ddp.jsonl"
A="--methods erm cat --steps 40"
CUDA_VISIBLE_DEVICES=0 timeout 80 python3 $B $A 2>"$OUT/ddp-1.err" | tee -a "$J"
timeout 80 torchrun --standalone --nproc_per_node 2 $B $A 2>>"$OUT/ddp-2.err" | tee -a "$J"
NCCL_MAX_CTAS=8 timeout 80 torchrun --standalone --nproc_per_node 2 $B $A 2>>"$OUT/ddp-2.err" | tee -a "$J"
timeout 80 torchrun --standalone --nproc_per_node 2 $B $A --bucket-mb 200 2>>"$OUT/ddp-2.err" | tee -a "$J"
