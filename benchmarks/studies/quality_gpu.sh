#!/usr/bin/env bash
# The quality protocols (docs/RESULTS-quality.md, commands: quality_jobs.py) on every GPU of the machine: PARALLEL
# CLI runs at once until DEADLINE seconds; every finished run's metrics.json is gathered into
# $OUT/quality-<name>.jsonl, logs into $OUT/quality-<name>-logs.tar.gz (jobs_gpu.sh).
#   bash benchmarks/studies/quality_gpu.sh NAME PROTOCOL [PROTOCOL ...]      (env: PARALLEL=12 DEADLINE=540)
PARALLEL=${PARALLEL:-12} exec bash "$(dirname "$0")/jobs_gpu.sh" quality "$@"
