"""Print the commands of the bias-model quality study (docs/RESULTS-debias.md), phase by phase.

MiniLM-L6 on CAD NLI, two training sets (``full``: originals + premise and hypothesis edits; ``orig``: originals
only), 5 seeds; ERM and reweight (1 − p_b and 1 / p_b), PoE, learned-mixin +H and conf-reg, each with the
word-overlap bias and a hypothesis-only bias; every run scores CAD dev and the HANS-style set (``--eval hans``).

Phases (each needs the previous one's outputs):
  bias   the overlap bias fitted on each training set; the hypothesis-only classifiers (a cat_fast ERM model
         trained on the hypothesis column of each training set, seed 0);
  column the hypothesis-only bias files (those classifiers' predictions for the training examples);
  erm    the ERM runs (also the conf-reg teachers, seed for seed, so they keep a checkpoint);
  runs   every debiased run.
The bias files do not depend on the seed: a device run for later seeds reuses the files of the first one.
Usage: python benchmarks/studies/debias_jobs.py PHASE [--seeds 0 1 ...] --root DIR
"""
import argparse

SEEDS = range(5)
DATA = {"full": "", "orig": "--data orig"}
# the originals file of each training set, as the bias models read it (train with --data orig uses these rows)
ORIG_FILE = "cad:nli/train/original"  # the shipped NLI originals, by name
BIAS_TRAIN = {"full": "", "orig": f"--train {ORIG_FILE}"}
HYP_TRAIN = {"full": "{root}/hyp-train-full.tsv", "orig": ORIG_FILE}
COMMON = ("--task nli --epochs 3 --batch-size 16 --max-length 128 --lr 5e-5 --model minilm --device cuda "
          "--overwrite --eval hans")
METHODS = ("reweight", "reweight-inverse", "poe", "learned-mixin", "conf-reg")
BIASES = ("overlap", "hyp")


def bias(root, seeds):
    for data in DATA:
        yield f"cat-fast bias fit --kind overlap --task nli {BIAS_TRAIN[data]} --out {root}/bias/overlap-{data} --overwrite"
        yield (f"cat-fast train --train {HYP_TRAIN[data].format(root=root)} --text-column sentence2 "
               "--label-column gold_label --labels entailment,neutral,contradiction --method erm --epochs 3 "
               f"--batch-size 16 --max-length 128 --lr 5e-5 --model minilm --device cuda --overwrite --seed 0 "
               f"--out {root}/bias/hyp-model-{data}")


def erm(root, seeds):
    for seed in seeds:
        for data in DATA:
            yield f"cat-fast train {COMMON} {DATA[data]} --method erm --seed {seed} --out {root}/{data}/erm/seed{seed}"


def column(root, seeds):
    for data in DATA:
        yield (f"cat-fast bias fit --kind column --task nli {BIAS_TRAIN[data]} --model {root}/bias/hyp-model-{data} "
               f"--column text_pair --device cuda --out {root}/bias/hyp-{data} --overwrite")


def runs(root, seeds):
    for seed in seeds:  # seeds outermost: a run cut short by a deadline leaves the same seeds for every cell
        for data in DATA:
            for bias in BIASES:
                for method in METHODS:
                    extra = f" --teacher {root}/{data}/erm/seed{seed}" if method == "conf-reg" else ""
                    yield (f"cat-fast train {COMMON} {DATA[data]} --method {method} --bias {root}/bias/{bias}-{data}"
                           f"{extra} --seed {seed} --no-checkpoint --out {root}/{data}/{method}+{bias}/seed{seed}")


def main():
    parser = argparse.ArgumentParser()
    phases = {"bias": bias, "column": column, "erm": erm, "runs": runs}
    parser.add_argument("phase", choices=tuple(phases))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--root", default="runs/debias")
    args = parser.parse_args()
    for line in phases[args.phase](args.root, args.seeds):
        print(" ".join(line.split()))


if __name__ == "__main__":
    main()
