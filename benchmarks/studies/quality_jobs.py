"""Print the `cat-fast train` commands of the quality protocols (docs/RESULTS-quality.md), one per line.

Seeds are interleaved (every method's seed 0 first) so that a run cut short by a deadline still has the
same seeds for every method. Usage: python benchmarks/studies/quality_jobs.py PROTOCOL [...] --root DIR
Protocols: sentiment, nli (full CAD train, the GS paper's Table 3 protocol) and fewshot-sentiment,
fewshot-nli (the CAT paper's Table 1 protocol: k originals per class, originals only for every method);
alternate-<protocol>: the `cat` runs of that protocol with the paper's alternating CRM/ERM update;
control-<protocol>: its `erm` runs as `erm-two-step` (two AdamW updates per batch, the alternating update's count).
--hans: every NLI run also scored on the HANS-style set.
tune-<sentiment|nli>: the equal tuning budget (docs/RESULTS-quality.md): the same number of configurations
(TUNING, 6) for every method, each trained with seeds 100 and 101 and scored on the tune half of dev (--dev-split
tune); then `python benchmarks/studies/tune_select.py ROOT.jsonl` picks each method's best by mean tune accuracy and prints its runs with
seeds 0-4 scored on the report half (--dev-split report, HANS too for NLI).
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


TUNING = {  # method -> the flags of its configurations (every method the same count)
    "erm": [f"--lr {lr} --epochs {ep}" for lr in ("2e-5", "5e-5", "1e-4") for ep in (3, 5)],
    "erm-two-step": [f"--lr {lr} --crm-lr {crm}" for lr in ("2e-5", "5e-5", "1e-4") for crm in ("2e-5", "5e-5")],
    # the CAT paper's appendix: A1, A2 within [0.9, 2]; gamma searched with eta = 2 gamma
    "cat-alternate": [f"--cat-update alternate --crm-lr 2e-5 --crm-clip {clip} --gamma {g} --eta {2 * g}"
                      for clip in ("0.9,1.1", "0.9,2") for g in (2.5, 5, 10)],
    "gs": [f"--gs-weight {w}" for w in ("0.1", "0.3", "1", "3", "10", "30")],
}
TUNING_SEEDS = (100, 101)


def tune_jobs(task, root):
    base = FULL[task] + (" --eval hans" if task == "nli" else "")
    for seed in TUNING_SEEDS:
        for method, configs in TUNING.items():
            for i, flags in enumerate(configs):
                name = "cat" if method == "cat-alternate" else method
                out = f"{root}/tune-{task}/{method}/c{i}/seed{seed}"
                # the configuration's flags come after the protocol's: later flags win in argparse
                yield f"cat-fast train {base} --method {name} {flags} --dev-split tune --seed {seed} {COMMON} --out {out}"


def jobs(protocol, root):
    if protocol.startswith("tune-"):
        yield from tune_jobs(protocol.split("-", 1)[1], root)
        return
    if protocol.startswith("control-"):
        # the equal-update control of the alternating CAT (docs/RESULTS-quality.md): ERM with a second AdamW step per batch at the CRM
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
                                                                      for b in bases) + ("tune-sentiment", "tune-nli"))
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
