#!/usr/bin/env bash
# Device call on 1 GPU (issue 23): every objective against the compiled plain step. (1) The mask-conversion and
# attention tests again (tests.log); (2) the step suite's new captured rows (GS exact, the four bias-model losses,
# CLP) beside the reduce-overhead compiled plain step at 8x128, 32x128 and 64x256 (step.json, summary.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 60 python3 -m pytest tests/layers/test_casts.py tests/layers/test_attention.py -q -p no:cacheprovider \
  > "$OUT/tests.log" 2>&1; echo "rc=$?" >> "$OUT/tests.log"
grep -E "passed|failed|FAILED|rc=" "$OUT/tests.log" | tail -8
step_rows 420 "8x128 32x128 64x256" "plain_compiled_ro gs_exact_captured poe_captured reweight_captured \
learned_mixin_captured conf_reg_captured clp_captured"
grep -E "error|Error" "$OUT/step.log" | head -20
python3 -c "
import json; d = json.load(open('$OUT/step.json'))
for b in d['benchmarks']:
    e = b['extra_info']
    print(b['name'], 'error:', e.get('error'), 'graphs:', e.get('captured_graphs'))
"
rm -f "$OUT/build.log"
