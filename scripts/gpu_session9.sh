#!/usr/bin/env bash
# Device call on 1 GPU (issue 23): the fused elementwise kernels of the training layer (residual add + LayerNorm
# forward/backward with the parameter and bias gradients; GELU backward + bias gradient) - their kernel tests, the
# layer's CUDA tests, the step tests (replayed steps = eager loop; step counter), the NaN op tests not finished last
# call; then one layer's fwd+bwd GPU time: the model's layer, the training layer unfused and fused, torch.compile.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 170 python3 -m pytest tests/kernels/test_residual_layer_norm.py tests/kernels/test_gelu_bias_backward.py \
  tests/layers/test_training.py tests/layers/test_resumed.py tests/test_step.py tests/objectives/test_erm.py \
  tests/integrations/test_step_graphs.py -q -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "rc=$?" >> "$OUT/tests.log"; grep -E "passed|failed|FAILED|rc=" "$OUT/tests.log" | tail -12
timeout 100 python3 -m pytest tests/ops/test_crm_loss.py tests/ops/test_cal_step.py tests/ops/test_nan.py -q \
  -p no:cacheprovider -k "cuda and nan" > "$OUT/ops.log" 2>&1
echo "rc=$?" >> "$OUT/ops.log"; grep -E "passed|failed|FAILED|rc=" "$OUT/ops.log" | tail -8
timeout 150 python3 benchmarks/tools/training_layer_host.py --compiled --calls 20 > "$OUT/layer.txt" 2>&1
echo "rc=$?" >> "$OUT/layer.txt"; grep -vE "Warning|warn" "$OUT/layer.txt" | tail -16
