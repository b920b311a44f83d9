#!/usr/bin/env bash
# Device call on 1 GPU (issue 23), after the GPU tests passed: cat-fast train with and without
# --step-graphs (MiniLM, NLI, CAT without a warm-up epoch, bf16): the same run through the Trainer's own step and
# through one CUDA graph per (batch shape, mixing layer); wall time and dev accuracy side by side.
set -uo pipefail
cd "$(dirname "$0")/.."
ls cat_fast/_C*.so > /dev/null 2>&1 || source scripts/device_setup.sh  # a warm machine keeps the build
[ -n "${CAT_FAST_MINILM_DIR:-}" ] || export CAT_FAST_MINILM_DIR="$PWD/.minilm" PYTHONPATH="$PWD:/tmp/site"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
T="--task nli --method cat --epochs 2 --warmup-epochs 0 --bf16 --seed 0 --no-checkpoint --batch-size 16"
for mode in plain graphs; do
  extra=""; [ "$mode" = graphs ] && extra="--step-graphs"
  s=$(date +%s)
  timeout 150 python3 -m cat_fast.cli train $T $extra --out "/tmp/sg-$mode" > "$OUT/train-$mode.log" 2>&1
  echo "$mode rc=$? wall=$(( $(date +%s) - s ))s" | tee -a "$OUT/train.txt"
  grep -h "wrote\|warning\|error" "$OUT/train-$mode.log" | tail -3 | tee -a "$OUT/train.txt"
  python3 -c "import json,sys; m=json.load(open('/tmp/sg-$mode/metrics.json')); print('$mode', 'train_s', m['train_seconds'], 'dev', m['eval']['dev'])" 2>&1 | tee -a "$OUT/train.txt"
done
