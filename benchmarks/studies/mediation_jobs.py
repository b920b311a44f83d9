"""Print the pipelines of the mediation quality study (docs/RESULTS-debias.md, "Masking and unlearning"), one line
per base model and seed: train it (or wait for the ERM teacher first, for conf-reg), run the exact mediation sweep,
then each variant (masking, unlearning, the paper's controls) and its evaluation on CAD dev and the HANS-style set.

MiniLM-L6 on full CAD NLI (originals + edits) with the word-overlap bias of the bias-model study
(debias_jobs.py: same training commands, same bias file), 5 seeds. Per model:
  mediation  exact sweep, bf16 autocast, 100 dev pairs per class, treatment = dev pairs >= the 95th percentile of
             hypothesis-word overlap (class-balanced), target "entailment" (the released code's settings); top-k =
             700 of 82,944 scaled to the model (175 of 20,736 for MiniLM-L6);
  mask                 the top-k neurons masked at the first token, the paper's 1/p rescale;
  mask-random          as many random neurons (the paper's "without CMA" control);
  unlearn              gradient unlearning of the top-k on the advantaged examples of the released code (gold
                       entailment, the bias predicts it, the model misses it), 15 epochs, batch 32, weight decay 0.1,
                       lr 1e-5 (cat-fast's default);
  unlearn-lr1e-4       the same at lr 1e-4;
  unlearn-lr1e-4-random-examples   control: as many random training examples instead of the advantaged ones;
  unlearn-lr1e-4-random-neurons    control: random neurons;
  unlearn-anyclass[-lr1e-4]        the paper's text: advantaged examples of every class.
Usage: python benchmarks/studies/mediation_jobs.py --seeds 0 1 ... --root DIR --bias DIR   (each line: a bash
command list using the `cat-fast` command; mediation_gpu.sh runs them in parallel; --variants: a subset)
"""
import argparse

from debias_jobs import COMMON

BASES = ("erm", "poe", "reweight", "learned-mixin", "conf-reg")
VARIANTS = {  # name -> (command, extra arguments)
    "mask": ("mask", "--rescale"),
    "mask-random": ("mask", "--rescale --random-neurons"),
    "unlearn-anyclass": ("unlearn", "--lr 1e-5"),
    "unlearn-anyclass-lr1e-4": ("unlearn", "--lr 1e-4"),
    "unlearn": ("unlearn", "--lr 1e-5 --candidate-class entailment"),
    "unlearn-lr1e-4": ("unlearn", "--lr 1e-4 --candidate-class entailment"),
    "unlearn-lr1e-4-random-examples": ("unlearn", "--lr 1e-4 --candidate-class entailment --examples random"),
    "unlearn-lr1e-4-random-neurons": ("unlearn", "--lr 1e-4 --candidate-class entailment --random-neurons"),
}


def pipeline(root, bias, base, seed, variants=tuple(VARIANTS)):
    model = f"{root}/models/{base}/seed{seed}"
    nie = f"{root}/nie/{base}/seed{seed}"
    steps = []
    if base == "conf-reg":  # its teacher is the ERM run of the same seed
        teacher = f"{root}/models/erm/seed{seed}"
        steps.append(f"until [ -f {teacher}/metrics.json ]; do [ $(date +%s) -lt ${{END:-0}} ] || exit 1; sleep 5; "
                     "done")
        extra = f"--bias {bias} --teacher {teacher}"
    else:
        extra = f"--bias {bias}" if base != "erm" else ""
    steps.append(f"cat-fast train {COMMON} --method {base} {extra} --seed {seed} --out {model}")
    steps.append(f"cat-fast mediation --model {model} --task nli --per-class 100 --bf16 --seed {seed} --device cuda "
                 f"--overwrite --out {nie}")
    commands = []
    for name in variants:
        command, args = VARIANTS[name]
        out = f"{root}/models/{base}+{name}/seed{seed}"
        data = f"--task nli --bias {bias} --device cuda" if command == "unlearn" else ""
        commands.append(f"{{ cat-fast {command} --model {model} --nie {nie} {data} {args} --seed {seed} --overwrite "
                        f"--out {out} && cat-fast eval --model {out} --eval hans --device cuda --overwrite "
                        f"--out {root}/evals/{base}+{name}/seed{seed}; }}")
    return " && ".join(steps) + " && { " + "; ".join(commands) + "; }"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(5)))
    parser.add_argument("--root", default="runs/mediation")
    parser.add_argument("--bias", default="runs/debias-bias/overlap-full")
    parser.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    for seed in args.seeds:
        for base in BASES:
            print(" ".join(pipeline(args.root, args.bias, base, seed, args.variants).split()))


if __name__ == "__main__":
    main()
