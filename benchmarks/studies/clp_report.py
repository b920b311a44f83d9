"""Tables of the CLP quality study (docs/RESULTS-clp.md) from the gathered metrics (clp_gpu.sh):
    python benchmarks/studies/clp_report.py docs/clp/clp-study.jsonl
Per task and scenario: mean ± sample SD (%) over seeds of each method, and the paired difference CLP − ERM
(erm-orig, the same data and seeds) with how many seeds it is positive."""
import json
import statistics as st
import sys
from collections import defaultdict

METRICS = {"nli": ("dev_orig", "dev_edit", "dev", "hans", "hans/non-entailment", "hans/entailment"),
           "sentiment": ("dev_orig", "dev_edit", "dev")}
SCENARIOS = ("shift", "noise20", "noise40", "longtail")


def fmt(values):
    if not values:
        return "–"
    m = 100 * st.mean(values)
    return f"{m:.1f} ± {100 * st.stdev(values):.1f}" if len(values) > 1 else f"{m:.1f}"


def paired(a, b):
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return "–"
    d = [a[s] - b[s] for s in seeds]
    sd = f" ± {100 * st.stdev(d):.1f}" if len(d) > 1 else ""
    return f"{100 * st.mean(d):+.1f}{sd} ({sum(x > 0 for x in d)}/{len(d)})"


def main(path):
    runs = defaultdict(dict)  # (task, scenario, method) -> seed -> eval
    for line in open(path):
        r = json.loads(line)
        task, scenario, method, seed = r["run"].split("/")
        runs[task, scenario, method][int(seed[4:])] = r["eval"]
    for task in ("nli", "sentiment"):
        metrics = METRICS[task]
        print(f"\n### {task}\n")
        print("| scenario | method | seeds | " + " | ".join(metrics) + " |")
        print("| --- | --- | --- | " + " | ".join("---" for _ in metrics) + " |")
        for scenario in SCENARIOS:
            methods = [m for m in ("erm-orig", "clp", "erm") if (task, scenario, m) in runs]
            for method in methods:
                cell = runs[task, scenario, method]
                vals = [fmt([e[k]["accuracy"] for e in cell.values() if k in e]) for k in metrics]
                print(f"| {scenario} | {method} | {len(cell)} | " + " | ".join(vals) + " |")
            a, b = runs.get((task, scenario, "clp"), {}), runs.get((task, scenario, "erm-orig"), {})
            diffs = [paired({s: e[k]["accuracy"] for s, e in a.items() if k in e},
                            {s: e[k]["accuracy"] for s, e in b.items() if k in e}) for k in metrics]
            print(f"| {scenario} | **CLP − ERM (paired)** | | " + " | ".join(diffs) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
