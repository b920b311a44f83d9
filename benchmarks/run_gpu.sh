#!/usr/bin/env bash
# The one command for the GPU machine: runs the benchmark suite, then writes the report.
#
#   benchmarks/run_gpu.sh [all|ops|step]        (or BENCH_SUBSET=all|ops|step; default all)
#
# Environment (all optional):
#   OUT                  where results go (default /tmp/cat_fast_bench): bench.json (pytest-benchmark),
#                        bench.jsonl (per-case backup), pytest.log, env.txt, RESULTS.md, tokens_per_s.png
#   BENCH_BUDGET_S       hard wall-clock limit of the pytest run, seconds (default 330); cases starting after
#                        their deadline skip (ops: BENCH_OPS_BUDGET_S, default 200 in `all`), so the report
#                        always gets written; the run is interrupted (SIGINT, pytest still writes its JSON) at the limit
#   CAT_FAST_BENCH_COMPILE=0           skip the torch.compile op cases (the slowest to set up)
#   CAT_FAST_BENCH_REPS / _WARMUP      op repetitions (default 20 / 5)
#   CAT_FAST_BENCH_STEP_STEPS / _STEP_WARMUP   step-level timed / warm-up steps (default 20 / 5, timed <= 25)
#   CAT_FAST_BENCH_COMMIT              commit to print in RESULTS.md (default: git rev-parse HEAD)
#   BENCH_RESULTS_DIR                  where RESULTS.md / tokens_per_s.png are written (default benchmarks)
#
# RESULTS.md / tokens_per_s.png are written to benchmarks/ (text outside the table markers is kept) AND copied
# to $OUT, since only $OUT comes back from the device machine.
set -uo pipefail
cd "$(dirname "$0")/.."

SUBSET="${1:-${BENCH_SUBSET:-all}}"
OUT="${OUT:-/tmp/cat_fast_bench}"
BUDGET="${BENCH_BUDGET_S:-330}"
OPS_BUDGET="${BENCH_OPS_BUDGET_S:-200}"
RESULTS_DIR="${BENCH_RESULTS_DIR:-benchmarks}"   # where RESULTS.md / tokens_per_s.png are (re)written
mkdir -p "$OUT"
START=$(date +%s)

ops_files="benchmarks/test_bench_cal_objective.py benchmarks/test_bench_cal_step.py benchmarks/test_bench_cmix.py
benchmarks/test_bench_crm_loss.py benchmarks/test_bench_gs_cosine_loss.py"
case "$SUBSET" in
  ops)  FILES="$ops_files"; export CAT_FAST_BENCH_DEADLINE_OPS=$((START + BUDGET - 25)) ;;
  step) FILES="benchmarks/test_bench_step.py"; export CAT_FAST_BENCH_DEADLINE_STEP=$((START + BUDGET - 40)) ;;
  all)  FILES="benchmarks"
        export CAT_FAST_BENCH_DEADLINE_OPS=$((START + OPS_BUDGET))
        export CAT_FAST_BENCH_DEADLINE_STEP=$((START + BUDGET - 40)) ;;
  *) echo "usage: $0 [all|ops|step]" >&2; exit 2 ;;
esac

export CAT_FAST_BENCH_JSONL="$OUT/bench.jsonl"
rm -f "$OUT/bench.jsonl" "$OUT/bench.json"

python - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "count", torch.cuda.device_count())
for name in ("triton", "transformers", "pytest_benchmark"):
    try:
        print(name, __import__(name).__version__)
    except Exception as error:
        print(name, "MISSING:", error)
import cat_fast
print("cat_fast backends", cat_fast.backends(), "load errors", cat_fast.ops._registry.load_errors())
PY

echo "== pytest ($SUBSET, budget ${BUDGET}s) =="
timeout -s INT -k 30 "$BUDGET" python -m pytest $FILES -q -p no:cacheprovider -rfEx \
    --benchmark-json "$OUT/bench.json" --benchmark-columns=median --benchmark-sort=name \
    >"$OUT/pytest.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR|XFAIL|SKIPPED)|passed|failed|error" "$OUT/pytest.log" | tail -40
[ $rc -eq 124 ] && echo "pytest hit the ${BUDGET}s limit (interrupted)"
echo "== pytest exit $rc after $(( $(date +%s) - START ))s =="

inputs=()
[ -f "$OUT/bench.json" ] && inputs+=("$OUT/bench.json")
[ -f "$OUT/bench.jsonl" ] && inputs+=("$OUT/bench.jsonl")
if [ ${#inputs[@]} -gt 0 ]; then
  mkdir -p "$RESULTS_DIR"
  python benchmarks/report.py "${inputs[@]}" --out "$RESULTS_DIR/RESULTS.md" --plot "$RESULTS_DIR/tokens_per_s.png"
  [ "$RESULTS_DIR" -ef "$OUT" ] || cp "$RESULTS_DIR/RESULTS.md" "$RESULTS_DIR/tokens_per_s.png" "$OUT/" 2>/dev/null
  sed -n '/<!-- tables:begin -->/,/<!-- tables:end -->/p' "$RESULTS_DIR/RESULTS.md" | grep -v "^#### \`\|^$" | cut -c1-220 | tail -150
else
  echo "no results to report"
fi
exit $rc
