#!/usr/bin/env bash
# Device run of the CLP quality study (docs/RESULTS-clp.md, commands: scripts/clp_jobs.py):
#   bash scripts/clp_gpu.sh NAME TASK [TASK ...]      (env: PARALLEL=16 DEADLINE=540 SEEDS="0 1 2 3 4")
# Every finished run's metrics.json goes to $OUT/clp-NAME.jsonl, the logs to $OUT/clp-NAME-logs.tar.gz.
name=$1; shift
exec bash "$(dirname "$0")/jobs_gpu.sh" clp "$name" "$@" --seeds ${SEEDS:-0 1 2 3 4}
