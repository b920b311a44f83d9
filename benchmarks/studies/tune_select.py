"""The equal tuning budget (docs/RESULTS-quality.md), second half: from the gathered metrics of
`quality_jobs.py tune-<task>` runs, each method's configuration with the best mean accuracy on the tune half of dev
(over seeds 100, 101), then the commands of its final runs (seeds 0-4, scored on the report half):
    python benchmarks/studies/tune_select.py TUNE.jsonl [--root DIR] [--extras]   (a table to stderr, the commands
    to stdout)
--extras: also the NLI ablations of that section with the chosen configurations, seeds 0-4 on the report half: GS with random
pairs (`gs-random`, GS's chosen weight), GS at the token level (the embedding output, first order, GS's chosen
weight), and CAT + GS under the alternating update (`cat-gs`, CAT's chosen clip and gamma, GS weight 1)."""
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
    p.add_argument("--extras", action="store_true", help="also the NLI ablations (module docstring)")
    args = p.parse_args()
    scores = defaultdict(list)  # (task, method, config index) -> tune accuracies
    chosen = {}  # (task, method) -> the chosen configuration's flags
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
            chosen[task, method] = configs[best]
            for seed in range(5):
                out = f"{args.root}/tuned-{task}/{method}/seed{seed}"
                print(f"cat-fast train {base} --method {name} {configs[best]} --dev-split report --seed {seed} "
                      f"{COMMON} --out {out}")
    if args.extras:
        for line in extras(chosen, args.root):
            print(line)


def extras(chosen, root):
    """Issue 22's NLI ablations with the chosen configurations (module docstring)."""
    if ("nli", "gs") not in chosen or ("nli", "cat-alternate") not in chosen:
        return
    base = FULL["nli"] + " --eval hans"
    runs = {"gs-random": f"--method gs-random {chosen['nli', 'gs']}",
            "gs-token": f"--method gs --gs-representation 0 --gs-mode first_order {chosen['nli', 'gs']}",
            "cat-gs-alternate": f"--method cat-gs {chosen['nli', 'cat-alternate']} --gs-weight 1"}
    for seed in range(5):
        for name, flags in runs.items():
            yield (f"cat-fast train {base} {flags} --dev-split report --seed {seed} {COMMON} "
                   f"--out {root}/tuned-nli/{name}/seed{seed}")


if __name__ == "__main__":
    main()
