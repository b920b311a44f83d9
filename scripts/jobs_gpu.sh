#!/usr/bin/env bash
# Device run of a study's `cat-fast` command lines, PARALLEL at once on every GPU until DEADLINE seconds:
#   bash scripts/jobs_gpu.sh STUDY NAME [ARGS ...]      (env: PARALLEL=16 DEADLINE=540)
# STUDY names the generator scripts/STUDY_jobs.py (quality, clp), run as `scripts/STUDY_jobs.py ARGS --root ROOT`.
# Every finished run's metrics.json goes to $OUT/STUDY-NAME.jsonl, the logs to $OUT/STUDY-NAME-logs.tar.gz.
# Wrapped by scripts/quality_gpu.sh and scripts/clp_gpu.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
study=$1 name=$2; shift 2
root=/tmp/$study
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export END=$(( $(date +%s) + ${DEADLINE:-540} ))
mkdir -p $root/logs
python3 "scripts/${study}_jobs.py" "$@" --root $root > $root/jobs.txt
t0=$(date +%s)
bash scripts/parallel_gpu.sh $root/jobs.txt $root/logs
echo "runs: $(wc -l < $root/jobs.txt), $(( $(date +%s) - t0 ))s" | tee -a "$OUT/gpu.txt"
python3 scripts/gather_metrics.py "$root" "$OUT/$study-$name.jsonl"
grep -h "EXIT\|SKIPPED" $root/logs/*.log | head -20
grep -h "Traceback" -A3 $root/logs/*.log | head -20
tar czf "$OUT/$study-$name-logs.tar.gz" -C $root logs
