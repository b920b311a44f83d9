#!/usr/bin/env bash
# Device call on 2 GPUs (issues 23 and 21): on GPU 0 the GPU tests of cat_fast.step.CapturedStep (ERM, CAT's
# whole-step graphs and their dropout, the Trainer's step_graphs) and of compiled models; the NCCL test through
# tests/ranks.spawn on both GPUs; then on GPU 0 the step suite with the compiled and captured rows (plain_captured,
# cat_captured; ratios: python scripts/paired_summary.py step.json). Results survive a time-out
# (CAT_FAST_BENCH_JSONL).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false CAT_FAST_BENCH_JSONL="$OUT/step.jsonl"
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest tests/test_step.py tests/objectives/test_compiled.py \
  tests/integrations/test_step_graphs.py -q \
  -p no:cacheprovider -rs > "$OUT/tests.log" 2>&1; echo "rc=$?" >> "$OUT/tests.log"; tail -15 "$OUT/tests.log"
timeout 120 python3 -m pytest tests/test_distributed.py -q -p no:cacheprovider -k gpu -rs > "$OUT/nccl.log" 2>&1
echo "rc=$?" >> "$OUT/nccl.log"; tail -5 "$OUT/nccl.log"
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/tools/training_layer_host.py --compiled --calls 20 \
  > "$OUT/layer.txt" 2>&1; tail -12 "$OUT/layer.txt"
CUDA_VISIBLE_DEVICES=0 CAT_FAST_BENCH_DEADLINE_STEP=$(( $(date +%s) + 220 )) timeout 250 python3 -m pytest \
  benchmarks/steps/test_bench_step.py -q -p no:cacheprovider \
  -k "test_step and (plain or cat or gs_first_order_fwd or gs_pooled)" \
  --benchmark-json "$OUT/step.json" > "$OUT/step.log" 2>&1; echo "rc=$?" >> "$OUT/step.log"
python3 scripts/paired_summary.py "$OUT/step.json" | tee "$OUT/summary.txt"
