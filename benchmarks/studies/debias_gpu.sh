#!/usr/bin/env bash
# The bias-model quality study (docs/RESULTS-debias.md, commands: debias_jobs.py) on every GPU of the machine:
#   bash benchmarks/studies/debias_gpu.sh NAME SEED [SEED ...]   (env: PARALLEL=16 DEADLINE=540 BIAS_DIR=... OUT=runs/studies)
# Fits the bias models (phases bias, column) unless BIAS_DIR holds the bias files of an earlier call
# (overlap-*/ hyp-*/ with bias.jsonl), then the ERM runs and the debiased runs of the given seeds, PARALLEL at
# once until DEADLINE seconds. Every finished run's metrics.json goes to $OUT/debias-NAME.jsonl, the bias files
# it fitted to $OUT/debias-bias.tar.gz, the logs to $OUT/debias-NAME-logs.tar.gz; the runs under runs/debias.
# Needs cat_fast installed with its GPU build.
set -uo pipefail
cd "$(dirname "$0")/../.."
here=benchmarks/studies
name=$1; shift
seeds="$*"
root=runs/debias
OUT=${OUT:-runs/studies}
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 root
mkdir -p $root/logs $root/bias "$OUT"
end=$(( $(date +%s) + ${DEADLINE:-540} ))
run_one() {
  local line="$1" end="$2" id
  id=$(echo "$line" | sed "s/.*--out //; s/ .*//; s|^$root/||; s|/|_|g")
  if [ "$(date +%s)" -ge "$end" ]; then echo "SKIPPED (deadline) $line" > "$root/logs/$id.log"; return; fi
  local left=$(( end - $(date +%s) ))
  timeout "$left" python3 -m cat_fast.cli ${line#cat-fast } > "$root/logs/$id.log" 2>&1 || echo "EXIT $? $line" >> "$root/logs/$id.log"
}
export -f run_one
run_jobs() {  # the commands of the phases given, all at once
  for phase in "$@"; do python3 $here/debias_jobs.py "$phase" --seeds $seeds --root $root; done > $root/jobs.txt
  local t0=$(date +%s)
  tr '\n' '\0' < $root/jobs.txt | xargs -0 -P "${PARALLEL:-16}" -I{} bash -c 'run_one "$1" "$2"' _ {} "$end"
  echo "phases $*: $(wc -l < $root/jobs.txt) jobs, $(( $(date +%s) - t0 ))s"
}
if [ -n "${BIAS_DIR:-}" ] && [ -f "$BIAS_DIR/overlap-full/bias.jsonl" ]; then
  cp -r "$BIAS_DIR"/overlap-* "$BIAS_DIR"/hyp-full "$BIAS_DIR"/hyp-orig $root/bias/
  echo "bias files from $BIAS_DIR"
  run_jobs erm
else
  # the hypothesis-only classifier of the full training set reads originals + both edit files
  d=cat_fast/data/cad/NLI
  { cat $d/original/train.tsv; tail -n +2 $d/revised_premise/train.tsv; tail -n +2 $d/revised_hypothesis/train.tsv; } \
    > $root/hyp-train-full.tsv
  run_jobs bias erm
  run_jobs column
  tar czf "$OUT/debias-bias.tar.gz" -C $root/bias overlap-full overlap-orig hyp-full/bias.jsonl hyp-full/bias_meta.json \
    hyp-orig/bias.jsonl hyp-orig/bias_meta.json hyp-model-full/metrics.json hyp-model-orig/metrics.json
fi
run_jobs runs
python3 $here/gather_metrics.py "$root" "$OUT/debias-$name.jsonl"
grep -l "EXIT\|SKIPPED" $root/logs/*.log | wc -l | xargs echo "runs not finished:"
grep -h -B3 "EXIT" $root/logs/*.log | tail -20
tar czf "$OUT/debias-$name-logs.tar.gz" -C $root logs
