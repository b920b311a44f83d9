#!/usr/bin/env bash
# Device call C of 2026-11-27 (every GPU of the machine): the CLP quality study (scripts/clp_jobs.py, issue 20) and
# issue 22's equal-update control with HANS (erm-two-step, and erm / cat-alternate on NLI again scored on HANS).
# The long full-CAD runs are listed first. Env: DEADLINE (s, default 520), PARALLEL (default 24).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
root=/tmp/q
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export END=$(( $(date +%s) + ${DEADLINE:-520} ))
mkdir -p $root/logs
{
  python3 scripts/quality_jobs.py control-nli alternate-nli control-sentiment --hans --root $root/quality
  python3 scripts/quality_jobs.py nli --hans --root $root/quality | grep -- "--method erm "
  for seed in 0 1 2 3 4; do python3 scripts/clp_jobs.py nli sentiment --seeds $seed --root $root/clp; done
} > $root/jobs.txt
echo "jobs: $(wc -l < $root/jobs.txt)"
t0=$(date +%s)
PARALLEL=${PARALLEL:-24} bash scripts/parallel_gpu.sh $root/jobs.txt $root/logs
echo "runs: $(wc -l < $root/jobs.txt), $(( $(date +%s) - t0 ))s" | tee -a "$OUT/gpu.txt"
python3 scripts/gather_metrics.py $root/clp "$OUT/clp.jsonl"
python3 scripts/gather_metrics.py $root/quality "$OUT/control.jsonl"
grep -h "EXIT\|SKIPPED" $root/logs/*.log | cut -c1-200 | head -20
grep -h "Traceback" -A3 $root/logs/*.log | head -20
tar czf "$OUT/logs.tar.gz" -C $root logs
