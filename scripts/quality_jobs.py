"""Print the `cat-fast train` commands of the quality protocols (docs/RESULTS-quality.md), one per line.

Seeds are interleaved (every method's seed 0 first) so that a run cut short by a deadline still has the
same seeds for every method. Usage: python scripts/quality_jobs.py PROTOCOL [...] --root DIR
Protocols: sentiment, nli (full CAD train, the GS paper's Table 3 protocol) and fewshot-sentiment,
fewshot-nli (the CAT paper's Table 1 protocol: k originals per class, originals only for every method);
alternate-<protocol>: the `cat` runs of that protocol with the paper's alternating CRM/ERM update;
control-<protocol>: its `erm` runs as `erm-two-step` (two AdamW updates per batch, the alternating update's count).
--hans: every NLI run also scored on the HANS-style set.
"""
import argparse

METHODS = ("erm-orig", "erm", "gs", "gs-random", "cat-star", "cat", "cat-gs")
FEWSHOT_METHODS = ("erm-orig", "cat-star", "cat")
SEEDS = range(5)
COMMON = "--model minilm --no-checkpoint --device cuda --overwrite"
FULL = {
    "sentiment": "--task sentiment --epochs 3 --batch-size 8 --max-length 256 --lr 5e-5",
    "nli": "--task nli --epochs 3 --batch-size 16 --max-length 128 --lr 5e-5",
}
FEWSHOT = {
    "sentiment": "--task sentiment --batch-size 8 --max-length 256 --lr 5e-5 --data orig",
    "nli": "--task nli --batch-size 8 --max-length 128 --lr 5e-5 --data orig",
}


def jobs(protocol, root):
    if protocol.startswith("control-"):
        # issue 22's equal-update control of the alternating CAT: ERM with a second AdamW step per batch at the CRM
        # step's learning rate, the same warm-up epoch (erm-two-step)
        base = protocol.split("-", 1)[1]
        for line in jobs(base, root):
            if " --method erm " in line:
                yield line.replace("--method erm ", "--method erm-two-step --crm-lr 2e-5 ").replace(
                    "/erm/", "/erm-two-step/")
        return
    if protocol.startswith("alternate-"):
        # CAT with the paper's alternating update (a separate CRM step, lr 2e-5) on the same protocols
        base = protocol.split("-", 1)[1]
        flags = "--method cat --cat-update alternate --crm-lr 2e-5"
        for line in jobs(base, root):
            if " --method cat " in line:
                yield line.replace("--method cat ", flags + " ").replace("/cat/", "/cat-alternate/")
        return
    if protocol in FULL:
        for seed in SEEDS:
            for method in METHODS:
                out = f"{root}/{protocol}/{method}/seed{seed}"
                yield f"cat-fast train {FULL[protocol]} --method {method} --seed {seed} {COMMON} --out {out}"
    else:
        task = protocol.split("-", 1)[1]
        for seed in SEEDS:
            for k in (10, 50):
                epochs = 30 if k < 50 else 20  # SPEC §1.4: 30 epochs under 50 samples per class, else 20
                for method in FEWSHOT_METHODS:
                    out = f"{root}/{protocol}/k{k}/{method}/seed{seed}"
                    yield (f"cat-fast train {FEWSHOT[task]} --per-class {k} --epochs {epochs} --method {method} "
                           f"--seed {seed} {COMMON} --out {out}")


def main():
    parser = argparse.ArgumentParser()
    bases = ("sentiment", "nli", "fewshot-sentiment", "fewshot-nli")
    parser.add_argument("protocols", nargs="+", choices=bases + tuple(f"{kind}-{b}" for kind in ("alternate", "control")
                                                                      for b in bases))
    parser.add_argument("--root", default="runs/quality")
    parser.add_argument("--hans", action="store_true", help="score every NLI run on the HANS-style set too (--eval hans)")
    args = parser.parse_args()
    for protocol in args.protocols:
        for line in jobs(protocol, args.root):
            if args.hans and " --task nli " in line:
                line = line.replace(" --task nli ", " --task nli --eval hans ")
            print(line)


if __name__ == "__main__":
    main()
