"""Write benchmarks/RESULTS.md (tables) and benchmarks/tokens_per_s.png from the suite's JSON output.

    python benchmarks/report.py OUT/bench.json [more.json | records.jsonl ...]
        [--out benchmarks/RESULTS.md] [--plot benchmarks/tokens_per_s.png] [--commit SHA] [--device NAME] [--date D]
        [--note TEXT] [--full-ops]

`benchmarks/run_gpu.sh` runs it on the run's raw results (OUT = benchmarks/results/<run>/ by default, ignored by
git) and writes OUT/RESULTS.md and OUT/tokens_per_s.png; pointing --out / --plot at benchmarks/RESULTS.md and
benchmarks/tokens_per_s.png makes a run the current tables of the committed file.

Inputs: `--benchmark-json` files of pytest-benchmark (or of the suite's stand-in fixture), and/or the
CAT_FAST_BENCH_JSONL backup written while the suite runs (used for cases missing from the JSON files,
e.g. when the run was killed before pytest wrote its JSON). Later inputs win on duplicate case names.

The tables are written between `<!-- tables:begin -->` and `<!-- tables:end -->`; everything else in an
existing RESULTS.md (narrative sections added by hand) is kept. Without the markers, the tables are
appended after the existing text. The work is done in `benchmarks/reporting/`.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repository root
from benchmarks.reporting.document import build, plot  # noqa: E402
from benchmarks.reporting.markdown import write_results  # noqa: E402
from benchmarks.reporting.ratios import with_copy_bandwidth  # noqa: E402
from benchmarks.reporting.results import load  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="report.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="--benchmark-json file(s) and/or CAT_FAST_BENCH_JSONL file(s)")
    parser.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    parser.add_argument("--plot", default=os.path.join(HERE, "tokens_per_s.png"))
    parser.add_argument("--commit", default=None, help="commit to print (default: from the JSON, else git rev-parse HEAD)")
    parser.add_argument("--device", default=None, help="device name to print (default: from the JSON)")
    parser.add_argument("--date", default=None, help="date to print (default: from the JSON)")
    parser.add_argument("--note", default=None, help="a paragraph printed under the header (e.g. which run gave which table)")
    parser.add_argument("--full-ops", action="store_true",
                        help="op tables with one row per backend (default: backends side by side, one row per case)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    paths = [p for p in args.inputs if os.path.exists(p)]
    missing = [p for p in args.inputs if not os.path.exists(p)]
    if missing:
        print(f"report.py: skipping missing input(s): {', '.join(missing)}", file=sys.stderr)
    if not paths:
        print("report.py: no input found", file=sys.stderr)
        return 1
    records, machine, commit_info = load(paths)
    machine = with_copy_bandwidth(machine, records)
    plotted = False
    try:
        plotted = plot(records, args.plot, args.device or machine.get("gpu"))
    except Exception as error:  # the tables matter more than the figure
        print(f"report.py: plot failed: {error}", file=sys.stderr)
    write_results(args.out, build(records, machine, commit_info, args, plotted))
    print(f"report.py: {len(records)} records -> {args.out}" + (f", {args.plot}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
