#!/usr/bin/env bash
# Run the command lines of JOBS (each a bash command list using `cat-fast`) PARALLEL at once on every GPU of the
# machine (line i on GPU i mod NGPU), each step bounded by the deadline END (epoch seconds, exported by the caller):
#   END=$(( $(date +%s) + 540 )) bash benchmarks/studies/parallel_gpu.sh JOBS LOGDIR      (env: PARALLEL=16)
# A step still running at END is killed (its line stops there); logs go to LOGDIR/jobN.log. Used by the study
# runners (mediation_gpu.sh, jobs_gpu.sh).
set -uo pipefail
jobs=$1 logs=$2
mkdir -p "$logs"
cat-fast() {  # each step gets the time left to the deadline
  local left=$(( END - $(date +%s) ))
  [ "$left" -gt 0 ] || { echo "SKIPPED (deadline) cat-fast $*"; return 124; }
  timeout "$left" python3 -m cat_fast.cli "$@" || { local rc=$?; echo "EXIT $rc cat-fast $*"; return $rc; }
}
export -f cat-fast
export END LOGS="$logs" NGPU=$(nvidia-smi -L | wc -l)
nl -ba -w1 -s' ' "$jobs" | tr '\n' '\0' | xargs -0 -P "${PARALLEL:-16}" -I{} bash -c \
  'line="$1"; id=${line%% *}; cmd=${line#* }; CUDA_VISIBLE_DEVICES=$(( id % NGPU )) bash -c "$cmd" \
     > "$LOGS/job$id.log" 2>&1' _ {}
