#!/usr/bin/env bash
# Device call on 1 GPU (issue 23), short: after the fused kernels' small-batch regression (8x128 layer 0.396 ms
# fused against 0.353 unfused: one partial-sum row per 2 rows), runs of at least 16 rows per program - the kernel
# and fused-layer tests, then one layer's fwd+bwd GPU time (own, unfused, fused, compiled).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 60 python3 -m pytest tests/kernels/test_residual_layer_norm.py tests/kernels/test_gelu_bias_backward.py \
  tests/layers/test_training.py -q -p no:cacheprovider -k "cuda or fused or fusion or match or reference" \
  > "$OUT/tests.log" 2>&1; echo "rc=$?" >> "$OUT/tests.log"; grep -E "passed|failed|FAILED|rc=" "$OUT/tests.log" | tail -6
timeout 100 python3 benchmarks/tools/training_layer_host.py --compiled --calls 15 > "$OUT/layer.txt" 2>&1
echo "rc=$?" >> "$OUT/layer.txt"; grep -vE "Warning|warn" "$OUT/layer.txt" | tail -16
