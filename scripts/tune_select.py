"""Issue 22's equal tuning budget, second half: from the gathered metrics of `quality_jobs.py tune-<task>` runs,
each method's configuration with the best mean accuracy on the tune half of dev (over seeds 100, 101), then the
commands of its final runs (seeds 0-4, scored on the report half):
    python scripts/tune_select.py TUNE.jsonl [--root DIR]      (prints a table to stderr, the commands to stdout)"""
import argparse
import json
import statistics
import sys
from collections import defaultdict

from quality_jobs import COMMON, FULL, TUNING


def main():
    p = argparse.ArgumentParser()
    p.add_argument("metrics")
    p.add_argument("--root", default="runs/quality")
    args = p.parse_args()
    scores = defaultdict(list)  # (task, method, config index) -> tune accuracies
    for line in open(args.metrics):
        r = json.loads(line)
        parts = r["run"].split("/")
        if len(parts) != 4 or not parts[0].startswith("tune-"):
            continue
        scores[parts[0][5:], parts[1], int(parts[2][1:])].append(r["eval"]["dev"]["accuracy"])
    for task in sorted({k[0] for k in scores}):
        for method, configs in TUNING.items():
            cells = {i: statistics.mean(scores[task, method, i]) for i in range(len(configs))
                     if scores.get((task, method, i))}
            if not cells:
                continue
            best = max(cells, key=cells.get)
            for i, acc in sorted(cells.items()):
                print(f"{task} {method} c{i} {configs[i]!r}: {100 * acc:.1f}{'  <- chosen' if i == best else ''}",
                      file=sys.stderr)
            base = FULL[task] + (" --eval hans" if task == "nli" else "")
            name = "cat" if method == "cat-alternate" else method
            for seed in range(5):
                out = f"{args.root}/tuned-{task}/{method}/seed{seed}"
                print(f"cat-fast train {base} --method {name} {configs[best]} --dev-split report --seed {seed} "
                      f"{COMMON} --out {out}")


if __name__ == "__main__":
    main()
