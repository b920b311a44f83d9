"""Tables of the bias-model quality study (docs/RESULTS-debias.md) from the gathered metrics (debias_gpu.sh).

Usage: python benchmarks/studies/debias_report.py docs/debias/debias-nli.jsonl
Per training set (full = originals + edits, orig = originals only) and cell (method + bias): mean ± sample
standard deviation over seeds of CAD dev accuracy and HANS-style accuracy per heuristic × label (in %), then each
cell's paired difference from ERM of the same seed.
"""
import argparse
import json
import statistics
from collections import defaultdict

HEURISTICS = ("lexical_overlap", "subsequence", "constituent")
COLUMNS = [("dev", "CAD dev"), ("dev_orig", "dev orig"), ("dev_edit", "dev edits"), ("hans", "HANS")] + [
    (f"hans/{h}/{label}", f"{h.split('_')[0][:4]} {'E' if label == 'entailment' else 'N'}")
    for h in HEURISTICS for label in ("entailment", "non-entailment")]
ORDER = ["erm"] + [f"{m}+{b}" for b in ("overlap", "hyp")
                   for m in ("reweight", "reweight-inverse", "poe", "learned-mixin", "conf-reg")]


def fmt(values, signed=False):
    if not values:
        return "—"
    mean = 100 * statistics.mean(values)
    sd = 100 * statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:+.1f} ± {sd:.1f}" if signed else f"{mean:.1f} ± {sd:.1f}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    cells = defaultdict(dict)  # (data, cell) -> seed -> eval
    for path in args.files:
        for line in open(path):
            m = json.loads(line)
            parts = m["run"].split("/")
            if len(parts) != 3 or parts[0] not in ("full", "orig"):
                continue
            cells[(parts[0], parts[1])][int(parts[2].removeprefix("seed"))] = m["eval"]
    header = "| cell | seeds | " + " | ".join(name for _, name in COLUMNS) + " |"
    rule = "| --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |"
    for data in ("full", "orig"):
        erm = cells.get((data, "erm"), {})
        for title, paired in (("accuracy (%)", False), ("difference from ERM, same seed (points)", True)):
            print(f"\n#### {data}: {title}\n\n{header}\n{rule}")
            for cell in ORDER:
                runs = cells.get((data, cell))
                if not runs or (paired and cell == "erm"):
                    continue
                row = [cell, str(len(runs))]
                for key, _ in COLUMNS:
                    if paired:
                        row.append(fmt([runs[s][key]["accuracy"] - erm[s][key]["accuracy"] for s in runs if s in erm],
                                       signed=True))
                    else:
                        row.append(fmt([r[key]["accuracy"] for r in runs.values()]))
                print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
