#!/usr/bin/env bash
# Device run of the quality protocols (docs/RESULTS-quality.md, commands: scripts/quality_jobs.py): PARALLEL CLI
# runs at once on every GPU until DEADLINE seconds; every finished run's metrics.json is gathered into
# $OUT/quality-<name>.jsonl, logs into $OUT/quality-<name>-logs.tar.gz.
#   bash scripts/quality_gpu.sh NAME PROTOCOL [PROTOCOL ...]      (env: PARALLEL=12 DEADLINE=540)
PARALLEL=${PARALLEL:-12} exec bash "$(dirname "$0")/jobs_gpu.sh" quality "$@"
