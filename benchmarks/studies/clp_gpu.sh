#!/usr/bin/env bash
# The CLP quality study (docs/RESULTS-clp.md, commands: clp_jobs.py) on every GPU of the machine:
#   bash benchmarks/studies/clp_gpu.sh NAME TASK [TASK ...]      (env: PARALLEL=16 DEADLINE=540 SEEDS="0 1 2 3 4")
# Every finished run's metrics.json goes to $OUT/clp-NAME.jsonl, the logs to $OUT/clp-NAME-logs.tar.gz (jobs_gpu.sh).
name=$1; shift
exec bash "$(dirname "$0")/jobs_gpu.sh" clp "$name" "$@" --seeds ${SEEDS:-0 1 2 3 4}
