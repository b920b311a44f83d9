#!/usr/bin/env bash
# Device call C of 2026-11-27 #2 (2 GPUs), issue 21 after call A: the fixed NCCL test and run_in_forward,
# the link's all-reduce bandwidth and NCCL's transport, DDP steps with and without PyTorch's bf16 compression
# hook, and cat-fast train --bf16 under torchrun against one GPU (MiniLM, CAD NLI, CAT, 1 epoch).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
L="$OUT/logs"; mkdir -p "$L"
timeout 120 python3 -m pytest tests/test_distributed.py -q -p no:cacheprovider -k "gpu or run_in_forward" -rs \
  > "$L/nccl-test.log" 2>&1; echo "rc=$?" >> "$L/nccl-test.log"; tail -2 "$L/nccl-test.log"
W=/tmp/runs; mkdir -p $W
T="--task nli --method cat --epochs 1 --bf16 --seed 0 --no-checkpoint"
s=$(date +%s)
timeout 120 torchrun --standalone --nproc_per_node 2 -m cat_fast.cli train $T --batch-size 16 --out $W/two \
  > "$L/train-2gpu.log" 2>&1
echo "rc=$? wall=$(( $(date +%s) - s ))s" | tee -a "$L/train-2gpu.log"; grep "wrote" "$L/train-2gpu.log"
s=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m cat_fast.cli train $T --batch-size 32 --out $W/one > "$L/train-1gpu.log" 2>&1
echo "rc=$? wall=$(( $(date +%s) - s ))s" | tee -a "$L/train-1gpu.log"; grep "wrote" "$L/train-1gpu.log"
cp $W/one/metrics.json "$L/train-1gpu-metrics.json"; cp $W/two/metrics.json "$L/train-2gpu-metrics.json"; ls $W/two >> "$L/train-2gpu.log"
B=benchmarks/tools/ddp_step_bench.py
J="$OUT/ddp.jsonl"
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 $B --methods erm cat gs 2>"$L/ddp-1.err" | tee -a "$J"
NCCL_DEBUG=INFO timeout 120 torchrun --standalone --nproc_per_node 2 $B --allreduce --methods erm cat gs \
  2>"$L/ddp-2.err" > "$L/ddp-2.out"; grep "^{" "$L/ddp-2.out" | tee -a "$J"; grep -h "via\|Channel 00\|P2P\|SHM" "$L/ddp-2.out" "$L/ddp-2.err" | head -12 > "$L/nccl-transport.txt"; cat "$L/nccl-transport.txt"
timeout 90 torchrun --standalone --nproc_per_node 2 $B --comm-hook bf16 --methods erm cat gs 2>"$L/ddp-2h.err" | tee -a "$J"
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
