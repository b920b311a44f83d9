#!/usr/bin/env bash
# Device call on 1 GPU (issue 23): after column_sums' narrower blocks and the one-row last hidden state of CAT's and
# GS's passes: (1) GPU tests (kernels, fast layers, models, captured step, ERM, CAT, GS, step-graph integration);
# (2) the step suite at 32x128 and 64x256 beside the compiled plain step; (3) the fast plain step's and CAT's kernels
# at 32x128 with the mixing layer fixed to 9 (kernels.tgz).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false CAT_FAST_BENCH_JSONL="$OUT/step.jsonl"
timeout 200 python3 -m pytest tests/kernels tests/layers tests/models tests/test_step.py tests/objectives/test_erm.py \
  tests/objectives/test_cat.py tests/objectives/test_gs.py tests/integrations/test_step_graphs.py -q \
  -p no:cacheprovider > "$OUT/tests.log" 2>&1; echo "rc=$?" >> "$OUT/tests.log"
grep -E "passed|failed|FAILED|rc=" "$OUT/tests.log" | tail -8
step_rows 200 "32x128 64x256" "plain_compiled_ro plain_fast_captured cat_captured"
timeout 90 python3 benchmarks/tools/profile_step.py --size 32x128 --steps 3 --cat-layer 9 --dump "$OUT/kernels" \
  plain_fast_captured cat_captured > "$OUT/diag.txt" 2>&1
grep -E "^== |by kind" "$OUT/diag.txt"
tar czf "$OUT/kernels.tgz" -C "$OUT" kernels && rm -rf "$OUT/kernels" "$OUT/build.log" "$OUT/step.jsonl"
