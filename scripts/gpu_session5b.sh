#!/usr/bin/env bash
# Prepared for the next one-GPU device call, issue 23: the GPU tests of cat_fast.step.CapturedStep (written
# 2026-11-27, never run on a GPU yet), the compiled-model tests on CUDA, and the step suite with the compiled plain
# rows at the three sizes (ratios: python scripts/paired_summary.py step.json). Results survive a time-out
# (CAT_FAST_BENCH_JSONL).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false CAT_FAST_BENCH_JSONL="$OUT/step.jsonl"
timeout 150 python3 -m pytest tests/test_step.py tests/objectives/test_compiled.py -q -p no:cacheprovider -rs \
  > "$OUT/tests.log" 2>&1; echo "rc=$?" >> "$OUT/tests.log"; tail -15 "$OUT/tests.log"
CAT_FAST_BENCH_DEADLINE_STEP=$(( $(date +%s) + 300 )) timeout 330 python3 -m pytest benchmarks/steps/test_bench_step.py \
  -q -p no:cacheprovider -k "test_step and (plain or cat or gs_first_order_fwd or gs_pooled)" \
  --benchmark-json "$OUT/step.json" > "$OUT/step.log" 2>&1; echo "rc=$?" >> "$OUT/step.log"
python3 scripts/paired_summary.py "$OUT/step.json" | tee "$OUT/summary.txt"
