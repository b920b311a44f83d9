#!/usr/bin/env bash
# Device call on 1 GPU (issue 23): after scripts/gpu_session7a.sh's two failures - CAT's eager Trainer step under
# bf16 (scripts/diag_cat_bf16.py) and eager-attention capture (models.capture_safe_masks) - the diagnosis and the
# GPU tests of the CAL graphs, the whole-step graphs and the GPU training steps.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 150 python3 scripts/diag_cat_bf16.py > "$OUT/diag.txt" 2>&1; echo "rc=$?" >> "$OUT/diag.txt"
grep "^trainer\|^loop\|rc=\|Error" "$OUT/diag.txt"
timeout 300 python3 -m pytest tests/test_step.py tests/integrations/test_step_graphs.py tests/models/test_masks.py \
  tests/objectives/test_cat_graphs.py tests/integrations/test_gpu_training.py -q -p no:cacheprovider -rs \
  > "$OUT/tests.log" 2>&1
echo "rc=$?" >> "$OUT/tests.log"; grep -E "passed|failed|FAILED|ERROR|rc=" "$OUT/tests.log" | tail -30
