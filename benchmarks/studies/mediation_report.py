"""Tables of the mediation quality study (docs/RESULTS-debias.md, "Masking and unlearning") from the gathered
metrics of mediation_gpu.sh.

Usage: python benchmarks/studies/mediation_report.py docs/debias/mediation-nli.jsonl [...]
Per base model (ERM and the bias-model baselines, full CAD NLI, overlap bias) and variant (masking, unlearning and
the paper's controls): mean ± sample standard deviation over seeds of CAD dev accuracy and HANS-style accuracy per
heuristic × label (in %), then each variant's paired difference from its own base model (same seed).
"""
import argparse
import json
from collections import defaultdict

from debias_report import COLUMNS, fmt

BASES = ("erm", "poe", "reweight", "learned-mixin", "conf-reg")
VARIANTS = ("mask", "mask-random", "unlearn", "unlearn-lr1e-4", "unlearn-lr1e-4-random-examples",
            "unlearn-lr1e-4-random-neurons", "unlearn-anyclass", "unlearn-anyclass-lr1e-4")


def load(files):
    """(run index, base, variant or "") -> seed -> eval; run index = the file's position (each device run trained its
    own base models, so a variant is paired with the base of its own run)."""
    cells = defaultdict(dict)
    for run, path in enumerate(files, 1):
        for line in open(path):
            m = json.loads(line)
            _, cell, seed = m["run"].split("/")
            base, _, variant = cell.partition("+")
            cells[(run, base, variant)][int(seed.removeprefix("seed"))] = m["eval"]
    return cells


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    cells = load(args.files)
    runs = range(1, len(args.files) + 1)
    header = "| model | run | seeds | " + " | ".join(name for _, name in COLUMNS) + " |"
    rule = "| --- | --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |"
    for title, paired in (("accuracy (%)", False), ("difference from the same model before masking / unlearning, "
                                                    "same run and seed (points)", True)):
        print(f"\n#### {title}\n\n{header}\n{rule}")
        for base in BASES:
            for variant in ("",) + VARIANTS:
                for run in runs:
                    got = cells.get((run, base, variant))
                    if not got or (paired and not variant):
                        continue
                    before = cells.get((run, base, ""), {})
                    row = [base + (f" + {variant}" if variant else ""), str(run), str(len(got))]
                    for key, _ in COLUMNS:
                        if paired:
                            row.append(fmt([got[s][key]["accuracy"] - before[s][key]["accuracy"] for s in got
                                            if s in before], signed=True))
                        else:
                            row.append(fmt([r[key]["accuracy"] for r in got.values()]))
                    print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
