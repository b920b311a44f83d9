#!/usr/bin/env bash
# A study's `cat-fast` command lines, PARALLEL at once on every GPU until DEADLINE seconds:
#   bash benchmarks/studies/jobs_gpu.sh STUDY NAME [ARGS ...]      (env: PARALLEL=16 DEADLINE=540 OUT=runs/studies)
# STUDY names the generator benchmarks/studies/STUDY_jobs.py (quality, clp), run as `STUDY_jobs.py ARGS --root ROOT`
# (ROOT: runs/STUDY). Every finished run's metrics.json goes to $OUT/STUDY-NAME.jsonl, the logs to
# $OUT/STUDY-NAME-logs.tar.gz. Wrapped by quality_gpu.sh and clp_gpu.sh. Needs cat_fast installed with its GPU build.
set -uo pipefail
cd "$(dirname "$0")/../.."
here=benchmarks/studies
study=$1 name=$2; shift 2
root=runs/$study
OUT=${OUT:-runs/studies}
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export END=$(( $(date +%s) + ${DEADLINE:-540} ))
mkdir -p $root/logs "$OUT"
python3 "$here/${study}_jobs.py" "$@" --root $root > $root/jobs.txt
t0=$(date +%s)
bash $here/parallel_gpu.sh $root/jobs.txt $root/logs
echo "runs: $(wc -l < $root/jobs.txt), $(( $(date +%s) - t0 ))s"
python3 $here/gather_metrics.py "$root" "$OUT/$study-$name.jsonl"
grep -h "EXIT\|SKIPPED" $root/logs/*.log | head -20
grep -h "Traceback" -A3 $root/logs/*.log | head -20
tar czf "$OUT/$study-$name-logs.tar.gz" -C $root logs
