"""The equal-tuning-budget tables (docs/RESULTS-quality.md, "The equal tuning budget") from the gathered metrics
of the final runs (`tuned-<task>/<method>/seed<k>`): means ± SD over seeds 0-4 on the report half of dev (and HANS
for NLI), then paired differences on the same seeds.
    python benchmarks/studies/tuning_report.py docs/quality/tuning-budget.jsonl"""
import argparse
import json
import statistics

COLUMNS = (("dev", "dev (report half)"), ("dev_orig", "originals"), ("dev_edit", "edits"), ("hans", "HANS"),
           ("hans/non-entailment", "HANS non-entailment"))
ORDER = {"nli": ("erm", "erm-two-step", "cat-alternate", "gs", "gs-random", "gs-token", "cat-gs-alternate"),
         "sentiment": ("erm", "erm-two-step", "cat-alternate", "gs")}
COMPARISONS = {
    "nli": (("erm-two-step", "erm"), ("cat-alternate", "erm"), ("gs", "erm"), ("cat-gs-alternate", "erm"),
            ("cat-alternate", "erm-two-step"), ("gs", "gs-random"), ("gs-token", "erm"),
            ("cat-gs-alternate", "cat-alternate")),
    "sentiment": (("erm-two-step", "erm"), ("cat-alternate", "erm"), ("gs", "erm"), ("cat-alternate", "erm-two-step")),
}
SEEDS = range(5)


def load(path):
    runs = {}
    for line in open(path):
        r = json.loads(line)
        parts = r["run"].split("/")
        if len(parts) == 3 and parts[0].startswith("tuned-"):
            runs[parts[0][6:], parts[1], int(parts[2][4:])] = r["eval"]
    return runs


def scores(runs, task, method, key):
    """Accuracy (%) of seeds 0-4, or None when a seed or the key is missing."""
    try:
        return [100 * runs[task, method, s][key]["accuracy"] for s in SEEDS]
    except KeyError:
        return None


def table(header):
    print("| task | " + header + " | " + " | ".join(c[1] for c in COLUMNS) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("metrics")
    runs = load(p.parse_args().metrics)
    label = {"nli": "NLI", "sentiment": "sentiment"}
    table("method")
    for task, methods in ORDER.items():
        for m in methods:
            cells = [(lambda v: "" if v is None else f"{statistics.mean(v):.1f} ± {statistics.stdev(v):.1f}")(
                scores(runs, task, m, key)) for key, _ in COLUMNS]
            print(f"| {label[task]} | {m} | " + " | ".join(cells) + " |")
    print()
    table("comparison")
    for task, pairs in COMPARISONS.items():
        for a, b in pairs:
            cells = []
            for key, _ in COLUMNS:
                x, y = scores(runs, task, a, key), scores(runs, task, b, key)
                if x is None or y is None:
                    cells.append("")
                    continue
                d = [u - v for u, v in zip(x, y)]
                cells.append(f"{statistics.mean(d):+.1f} ± {statistics.stdev(d):.1f} ({sum(e > 0 for e in d)}/5)")
            print(f"| {label[task]} | {a} − {b} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
