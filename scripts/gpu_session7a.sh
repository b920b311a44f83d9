#!/usr/bin/env bash
# Device call on 1 GPU (issue 23): the GPU tests of cat_fast.step.CapturedStep (every objective's replay against its
# eager step, CAT's dropout, the Trainer's step_graphs) and of compiled models; then the training layer against
# torch.compile(layer). The step suite follows in a second call on the warm machine (scripts/gpu_session6b.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 280 python3 -m pytest tests/test_step.py tests/objectives/test_compiled.py \
  tests/integrations/test_step_graphs.py -q -p no:cacheprovider -rs --durations=15 > "$OUT/tests.log" 2>&1
echo "rc=$?" >> "$OUT/tests.log"; grep -E "passed|failed|FAILED|ERROR|rc=" "$OUT/tests.log" | tail -30
timeout 120 python3 benchmarks/tools/training_layer_host.py --compiled --calls 20 > "$OUT/layer.txt" 2>&1
tail -14 "$OUT/layer.txt"
