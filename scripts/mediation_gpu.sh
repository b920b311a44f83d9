#!/usr/bin/env bash
# Device run of the mediation quality study (docs/RESULTS-debias.md, pipelines: scripts/mediation_jobs.py):
#   bash scripts/mediation_gpu.sh NAME SEED [SEED ...]      (env: PARALLEL=16 DEADLINE=540 VARIANTS="a b"; every GPU is used)
# Needs carry: runs/debias-bias (the overlap bias file of the bias-model study). Runs one pipeline per base model and
# seed, PARALLEL at once until DEADLINE seconds (a step still running then is killed; the pipeline stops). Every
# finished run's metrics.json goes to $OUT/mediation-NAME.jsonl, the NIE outputs and the mask / unlearn records to
# $OUT/mediation-NAME-nie.tar.gz, the logs to $OUT/mediation-NAME-logs.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
name=$1; shift
root=/tmp/mediation
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export END=$(( $(date +%s) + ${DEADLINE:-540} ))
mkdir -p $root/logs
python3 scripts/mediation_jobs.py --seeds "$@" --root $root --bias "$PWD/runs/debias-bias/overlap-full" \
  ${VARIANTS:+--variants $VARIANTS} > $root/jobs.txt
t0=$(date +%s)
bash scripts/parallel_gpu.sh $root/jobs.txt $root/logs
echo "pipelines: $(wc -l < $root/jobs.txt), $(( $(date +%s) - t0 ))s" | tee -a "$OUT/gpu.txt"
python3 scripts/gather_metrics.py "$root" "$OUT/mediation-$name.jsonl"
grep -h "EXIT\|SKIPPED" $root/logs/*.log | head -20
grep -h "Traceback" -A3 $root/logs/*.log | head -20
( cd $root && find nie models -name mediation.json -o -name top_neurons.tsv -o -name nie.pt -o -name mask.json \
    -o -name unlearn.json | tar czf "$OUT/mediation-$name-nie.tar.gz" -T - )
tar czf "$OUT/mediation-$name-logs.tar.gz" -C $root logs
