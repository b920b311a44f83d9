#!/usr/bin/env bash
# Device call on 2 GPUs (issues 23 and 21): on GPU 0 the GPU tests of cat_fast.step.CapturedStep (ERM, CAT's
# whole-step graphs and their dropout, the Trainer's step_graphs) and of compiled models; the NCCL test through
# tests/ranks.spawn on both GPUs; the training layer against torch.compile(layer). The step suite is
# scripts/gpu_session6b.sh (a second call: one call may run 600 s).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest tests/test_step.py tests/objectives/test_compiled.py \
  tests/integrations/test_step_graphs.py -q \
  -p no:cacheprovider -rs > "$OUT/tests.log" 2>&1; echo "rc=$?" >> "$OUT/tests.log"; tail -15 "$OUT/tests.log"
timeout 120 python3 -m pytest tests/test_distributed.py -q -p no:cacheprovider -k gpu -rs > "$OUT/nccl.log" 2>&1
echo "rc=$?" >> "$OUT/nccl.log"; tail -5 "$OUT/nccl.log"
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/tools/training_layer_host.py --compiled --calls 20 \
  > "$OUT/layer.txt" 2>&1; tail -12 "$OUT/layer.txt"
