#!/usr/bin/env bash
# Device run of the CLP quality study (docs/RESULTS-clp.md, commands: scripts/clp_jobs.py):
#   bash scripts/clp_gpu.sh NAME TASK [TASK ...]      (env: PARALLEL=16 DEADLINE=540 SEEDS="0 1 2 3 4")
# Every finished run's metrics.json goes to $OUT/clp-NAME.jsonl, the logs to $OUT/clp-NAME-logs.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
name=$1; shift
root=/tmp/clp
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export END=$(( $(date +%s) + ${DEADLINE:-540} ))
mkdir -p $root/logs
python3 scripts/clp_jobs.py "$@" --seeds ${SEEDS:-0 1 2 3 4} --root $root > $root/jobs.txt
t0=$(date +%s)
bash scripts/parallel_gpu.sh $root/jobs.txt $root/logs
echo "runs: $(wc -l < $root/jobs.txt), $(( $(date +%s) - t0 ))s" | tee -a "$OUT/gpu.txt"
python3 scripts/gather_metrics.py "$root" "$OUT/clp-$name.jsonl"
grep -h "EXIT\|SKIPPED" $root/logs/*.log | head -20
grep -h "Traceback" -A3 $root/logs/*.log | head -20
tar czf "$OUT/clp-$name-logs.tar.gz" -C $root logs
