"""Tables of the mediation quality study (docs/RESULTS-debias.md, "Masking and unlearning") from the gathered
metrics of scripts/mediation_gpu.sh.

Usage: python scripts/mediation_report.py docs/debias/mediation-nli.jsonl [...]
Per base model (ERM and the bias-model baselines, full CAD NLI, overlap bias) and variant (masking, unlearning and
the paper's controls): mean ± sample standard deviation over seeds of CAD dev accuracy and HANS-style accuracy per
heuristic × label (in %), then each variant's paired difference from its own base model (same seed).
"""
import argparse
import json
from collections import defaultdict

from debias_report import COLUMNS, fmt

BASES = ("erm", "poe", "reweight", "learned-mixin", "conf-reg")
VARIANTS = ("mask", "mask-random", "unlearn", "unlearn-lr1e-4", "unlearn-lr1e-4-random-neurons",
            "unlearn-lr1e-4-random-examples")


def load(files):
    cells = defaultdict(dict)  # (base, variant or "") -> seed -> eval
    for path in files:
        for line in open(path):
            m = json.loads(line)
            kind, cell, seed = m["run"].split("/")
            base, _, variant = cell.partition("+")
            cells[(base, variant)][int(seed.removeprefix("seed"))] = m["eval"]
    return cells


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    cells = load(args.files)
    header = "| model | seeds | " + " | ".join(name for _, name in COLUMNS) + " |"
    rule = "| --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |"
    for title, paired in (("accuracy (%)", False), ("difference from the model before masking / unlearning, same "
                                                    "seed (points)", True)):
        print(f"\n#### {title}\n\n{header}\n{rule}")
        for base in BASES:
            before = cells.get((base, ""), {})
            for variant in ("",) + VARIANTS:
                runs = cells.get((base, variant))
                if not runs or (paired and not variant):
                    continue
                name = base + (f" + {variant}" if variant else "")
                row = [name, str(len(runs))]
                for key, _ in COLUMNS:
                    if paired:
                        row.append(fmt([runs[s][key]["accuracy"] - before[s][key]["accuracy"] for s in runs
                                        if s in before], signed=True))
                    else:
                        row.append(fmt([r[key]["accuracy"] for r in runs.values()]))
                print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
