#!/usr/bin/env bash
# Device run of the quality protocols: PARALLEL CLI runs at once until DEADLINE seconds; every finished
# run's metrics.json is gathered into $OUT/quality-<name>.jsonl, logs into $OUT/quality-<name>-logs.tar.gz.
#   bash scripts/quality_gpu.sh NAME PROTOCOL [PROTOCOL ...]      (env: PARALLEL=12 DEADLINE=540)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_setup.sh
name=$1; shift
root=/tmp/quality
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
mkdir -p $root/logs
python3 scripts/quality_jobs.py "$@" --root $root > $root/jobs.txt
echo "$(wc -l < $root/jobs.txt) jobs, parallel ${PARALLEL:-12}, deadline ${DEADLINE:-540}s"
end=$(( $(date +%s) + ${DEADLINE:-540} ))
run_one() {
  local line="$1" end="$2" id
  id=$(echo "$line" | sed 's/.*--out //; s|/tmp/quality/||; s|/|_|g')
  if [ "$(date +%s)" -ge "$end" ]; then echo "SKIPPED (deadline) $line" > "/tmp/quality/logs/$id.log"; return; fi
  local left=$(( end - $(date +%s) ))
  timeout "$left" python3 -m cat_fast.cli ${line#cat-fast } > "/tmp/quality/logs/$id.log" 2>&1 || echo "EXIT $? $line" >> "/tmp/quality/logs/$id.log"
}
export -f run_one
tr '\n' '\0' < $root/jobs.txt | xargs -0 -P "${PARALLEL:-12}" -I{} bash -c 'run_one "$1" "$2"' _ {} "$end"
python3 scripts/gather_metrics.py "$root" "$OUT/quality-$name.jsonl"
grep -l "EXIT\|SKIPPED" $root/logs/*.log | wc -l | xargs echo "runs not finished:"
grep -h "EXIT" $root/logs/*.log | head -5
tar czf "$OUT/quality-$name-logs.tar.gz" -C $root logs
