#!/usr/bin/env bash
# The mediation quality study (docs/RESULTS-debias.md, pipelines: mediation_jobs.py) on every GPU of the machine:
#   bash benchmarks/studies/mediation_gpu.sh NAME SEED [SEED ...]   (env: PARALLEL=16 DEADLINE=540 VARIANTS="a b")
# Needs runs/debias-bias (the overlap bias file of the bias-model study: $OUT/debias-bias.tar.gz of debias_gpu.sh,
# unpacked) and cat_fast installed with its GPU build. Runs one pipeline per base model and seed under
# runs/mediation, PARALLEL at once until DEADLINE seconds (a step still running then is killed; the pipeline stops).
# Every finished run's metrics.json goes to $OUT/mediation-NAME.jsonl, the NIE outputs and the mask / unlearn records
# to $OUT/mediation-NAME-nie.tar.gz, the logs to $OUT/mediation-NAME-logs.tar.gz (OUT: runs/studies by default).
set -uo pipefail
cd "$(dirname "$0")/../.."
here=benchmarks/studies
name=$1; shift
root=runs/mediation
OUT=${OUT:-runs/studies}
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export END=$(( $(date +%s) + ${DEADLINE:-540} ))
mkdir -p $root/logs "$OUT"
OUT=$(cd "$OUT" && pwd)
python3 $here/mediation_jobs.py --seeds "$@" --root $root --bias "$PWD/runs/debias-bias/overlap-full" \
  ${VARIANTS:+--variants $VARIANTS} > $root/jobs.txt
t0=$(date +%s)
bash $here/parallel_gpu.sh $root/jobs.txt $root/logs
echo "pipelines: $(wc -l < $root/jobs.txt), $(( $(date +%s) - t0 ))s"
python3 $here/gather_metrics.py "$root" "$OUT/mediation-$name.jsonl"
grep -h "EXIT\|SKIPPED" $root/logs/*.log | head -20
grep -h "Traceback" -A3 $root/logs/*.log | head -20
( cd $root && find nie models -name mediation.json -o -name top_neurons.tsv -o -name nie.pt -o -name mask.json \
    -o -name unlearn.json | tar czf "$OUT/mediation-$name-nie.tar.gz" -T - )
tar czf "$OUT/mediation-$name-logs.tar.gz" -C $root logs
