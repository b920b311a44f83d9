#!/usr/bin/env bash
# Device call D of 2026-11-27 (4 GPUs), everything side by side on separate GPUs:
#   GPU 0: the whole BERT-base bf16 mediation sweep with the fp32 looped reference in the same process (issue 19);
#   GPU 1: DDP step bench, 1 process (ERM, CAT, GS first-order, 64x256 bf16), then the compiled plain step rows;
#   GPUs 2,3: DDP step bench, 2 processes (NCCL); then the BERT-base bf16 sweep on 2 GPUs compared
#             with the one-GPU sweep of run AO (.sweeps/bert-bf16-1gpu.pt, carried).
# The extension builds while GPU 0 starts (the sweep needs no compiled op).
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 CAT_FAST_MINILM_DIR="$PWD/.minilm"
[ -f .bench_commit ] && export CAT_FAST_BENCH_COMMIT="$(cat .bench_commit)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="$PWD:/tmp/site"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
T=benchmarks/tools/mediation_sweep_time.py
( CUDA_VISIBLE_DEVICES=0 timeout 345 python3 $T --model bert-base --precision bf16 --looped-neurons 72 \
    --out "$OUT/sweeps.jsonl" > "$OUT/sweep-1gpu.log" 2>&1; echo "rc=$?" >> "$OUT/sweep-1gpu.log" ) &
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 setup.py build_ext --inplace -j 16 > "$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; }
python3 -c "import cat_fast; print('backends', cat_fast.backends())" | tee -a "$OUT/gpu.txt"
B=benchmarks/tools/ddp_step_bench.py
(
  CUDA_VISIBLE_DEVICES=1 timeout 150 python3 $B --methods erm cat gs --size 64x256 > "$OUT/ddp-1.log" 2>&1
  echo "rc=$?" >> "$OUT/ddp-1.log"
  CUDA_VISIBLE_DEVICES=1 CAT_FAST_BENCH_DEADLINE_STEP=$(( $(date +%s) + 170 )) timeout 200 python3 -m pytest \
    benchmarks/steps/test_bench_step.py -q -p no:cacheprovider -k "test_step and compiled" \
    --benchmark-json "$OUT/step-compiled.json" > "$OUT/step-compiled.log" 2>&1
  echo "rc=$?" >> "$OUT/step-compiled.log"
) &
(
  export CUDA_VISIBLE_DEVICES=2,3
  timeout 150 torchrun --standalone --nproc_per_node 2 $B --methods erm cat gs --size 64x256 > "$OUT/ddp-2.log" 2>&1
  echo "rc=$?" >> "$OUT/ddp-2.log"
  timeout 190 torchrun --standalone --nproc_per_node 2 $T --model bert-base --precision bf16 \
    --compare .sweeps/bert-bf16-1gpu.pt --out "$OUT/sweeps.jsonl" > "$OUT/sweep-2gpu.log" 2>&1
  echo "rc=$?" >> "$OUT/sweep-2gpu.log"
) &
wait
for f in "$OUT"/*.log; do echo "== $f"; grep -v "^W1127\|^\*\*\*\|Warning\|warn" "$f" | tail -4; done
cat "$OUT/sweeps.jsonl"
