#!/usr/bin/env bash
# The one command for the GPU machine: runs the benchmark suite (benchmarks/ops/, benchmarks/steps/), then the report.
#
#   bash benchmarks/run_gpu.sh [all|ops|step]        (or BENCH_SUBSET=all|ops|step; default all)
#
# Raw results stay out of git: everything goes to OUT, by default benchmarks/results/<UTC date>-<commit>/ (ignored):
# bench.json (pytest-benchmark --benchmark-json), bench.jsonl (per-case backup, written as the cases finish),
# pytest.log, env.txt, and RESULTS.md / tokens_per_s.png generated from them by benchmarks/report.py.
# To make a run the current tables of the committed benchmarks/RESULTS.md (only the block between its table
# markers is replaced) and plot:
#   python benchmarks/report.py OUT/bench.json OUT/bench.jsonl --out benchmarks/RESULTS.md --plot benchmarks/tokens_per_s.png
# (or BENCH_RESULTS_DIR=benchmarks here), then add a line to its History.
#
# Environment (all optional):
#   OUT                  where the raw results and the generated report go (see above)
#   BENCH_BUDGET_S       hard wall-clock limit of the pytest run, seconds (default 330); cases starting after
#                        their deadline skip (ops: BENCH_OPS_BUDGET_S, default 200 in `all`), so the report
#                        always gets written; the run is interrupted (SIGINT, pytest still writes its JSON) at the limit
#   CAT_FAST_BENCH_COMPILE=0           skip the torch.compile op cases (the slowest to set up)
#   CAT_FAST_BENCH_REPS / _WARMUP      op repetitions (default 20 / 5)
#   CAT_FAST_BENCH_STEP_STEPS / _STEP_WARMUP   step-level timed / warm-up steps (default 20 / 5, timed <= 25)
#   CAT_FAST_BENCH_COMMIT              commit to print in the report (default: git rev-parse HEAD)
#   BENCH_RESULTS_DIR                  also write RESULTS.md / tokens_per_s.png there (e.g. benchmarks: the
#                                      committed file's table block; default: OUT only)
set -uo pipefail
cd "$(dirname "$0")/.."

SUBSET="${1:-${BENCH_SUBSET:-all}}"
COMMIT="${CAT_FAST_BENCH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
OUT="${OUT:-benchmarks/results/$(date -u +%Y-%m-%d-%H%M%S)-${COMMIT:0:7}}"
BUDGET="${BENCH_BUDGET_S:-330}"
OPS_BUDGET="${BENCH_OPS_BUDGET_S:-200}"
RESULTS_DIR="${BENCH_RESULTS_DIR:-$OUT}"   # where RESULTS.md / tokens_per_s.png are (re)written
mkdir -p "$OUT"
START=$(date +%s)

case "$SUBSET" in
  ops)  FILES="benchmarks/ops"; export CAT_FAST_BENCH_DEADLINE_OPS=$((START + BUDGET - 25)) ;;
  step) FILES="benchmarks/steps"; export CAT_FAST_BENCH_DEADLINE_STEP=$((START + BUDGET - 40)) ;;
  all)  FILES="benchmarks/ops benchmarks/steps"
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
print("cat_fast backends", cat_fast.backends(), "load errors", cat_fast.ops.registry.load_errors())
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
  python benchmarks/report.py "${inputs[@]}" --out "$OUT/RESULTS.md" --plot "$OUT/tokens_per_s.png"
  [ "$RESULTS_DIR" -ef "$OUT" ] || python benchmarks/report.py "${inputs[@]}" --out "$RESULTS_DIR/RESULTS.md" \
      --plot "$RESULTS_DIR/tokens_per_s.png"
  echo "raw results and report: $OUT"
  sed -n '/<!-- tables:begin -->/,/<!-- tables:end -->/p' "$RESULTS_DIR/RESULTS.md" | grep -v "^#### \`\|^$" | cut -c1-220 | tail -150
else
  echo "no results to report"
fi
exit $rc
