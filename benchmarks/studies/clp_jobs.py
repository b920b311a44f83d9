"""Print the `cat-fast train` commands of the CLP quality study (docs/RESULTS-clp.md), one per line.

The paper's scenarios transposed to CAD with MiniLM-L6, 5 seeds, CLP (head-only virtual step; metadata: a balanced
draw of 10 dev originals per class with their edits, left out of the dev score) against ERM on the same data:
  shift     train on the originals only (erm-orig, clp) — scored on the dev edits and, for NLI, the HANS-style set;
            `erm` (originals + edits) is the reference that trains on the edits themselves;
  noise20, noise40   20 % / 40 % of the training labels replaced by another class (--label-noise);
  longtail  one class (neutral for NLI, Negative for sentiment) cut to 10 % of its examples (--long-tail).
Every run is scored on the same dev set: the ERM runs leave out the groups that CLP's draw of the same seed takes
(--meta-holdout).
Seeds outermost, so a run cut short by a deadline keeps the same seeds for every cell.
Usage: python benchmarks/studies/clp_jobs.py TASK [...] [--seeds 0 1 ...] --root DIR
"""
import argparse

COMMON = "--model minilm --no-checkpoint --device cuda --overwrite"
TASK = {
    "nli": "--task nli --epochs 3 --batch-size 16 --max-length 128 --lr 5e-5 --eval hans",
    "sentiment": "--task sentiment --epochs 3 --batch-size 8 --max-length 256 --lr 5e-5",
}
TAIL = {"nli": "neutral", "sentiment": "Negative"}
SCENARIOS = {  # name -> (extra training flags, methods)
    "shift": ("", ("erm-orig", "clp", "erm")),
    "noise20": ("--label-noise 0.2", ("erm-orig", "clp")),
    "noise40": ("--label-noise 0.4", ("erm-orig", "clp")),
    "longtail": ("--long-tail {tail}=0.1", ("erm-orig", "clp")),
}


def jobs(task, seeds, root):
    for seed in seeds:
        for scenario, (flags, methods) in SCENARIOS.items():
            for method in methods:
                out = f"{root}/{task}/{scenario}/{method}/seed{seed}"
                extra = flags.format(tail=TAIL[task]) + ("" if method == "clp" else " --meta-holdout")
                yield f"cat-fast train {TASK[task]} {extra} --method {method} --seed {seed} {COMMON} --out {out}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("tasks", nargs="+", choices=tuple(TASK))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(5)))
    parser.add_argument("--root", default="runs/clp")
    args = parser.parse_args()
    for task in args.tasks:
        for line in jobs(task, args.seeds, args.root):
            print(" ".join(line.split()))


if __name__ == "__main__":
    main()
