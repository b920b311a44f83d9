"""``cat-fast mediation``, ``mask`` and ``unlearn``'s options."""
from __future__ import annotations

import argparse

from .arguments import SEED_MAX, add_column_options, seed_int
from .common import nonneg_int, positive_int

__all__ = ["add_mediation", "MASK_RECIPE"]

MASK_RECIPE = """\
A bias-model loss followed by masking (the paper's combination), on your own data (columns found by name; here
a column cue marks the rows that carry the shortcut; NLI pairs: bias fit --kind overlap, and mediation's default):
  cat-fast bias fit --kind features --feature-columns cue --train train.tsv --out bias
  cat-fast train --method poe --bias bias --train train.tsv --dev dev.tsv --out poe
  cat-fast mediation --model poe --samples dev.tsv --treatment-where cue=yes --target-class pos --out poe-nie
  cat-fast mask --model poe --nie poe-nie --select-k --select-dev dev.tsv --out poe-masked
(--k-rule best-on:anti.tsv: the k of the best accuracy on a small cue-balanced or anti-correlated set.) The
masked model's choice of k is in poe-masked/k_selection.json. unlearn has no --select-k (each k is a training
run): pass the k chosen here as its --top-k."""


class _RecipeFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and the epilog's command lines kept as written."""


def add_mediation(sub, fmt) -> None:
    """Add the ``mediation``, ``mask`` and ``unlearn`` commands to the `cat-fast` subparsers `sub` (help formatter `fmt`)."""
    md = sub.add_parser("mediation", help="the NIE of every neuron (causal mediation analysis)", formatter_class=fmt,
                        description="Causal mediation analysis of a trained classifier's neurons, on single texts or "
                                    "text pairs (see `python -m pydoc cat_fast.cli.mediation`).")
    md.add_argument("--model", required=True, metavar="DIR", help="a trained classifier (cat-fast train --out DIR)")
    md.add_argument("--task", choices=("sentiment", "nli"), help="the built-in CAD dev set as samples")
    md.add_argument("--samples", metavar="FILE", help="samples from your own file (with the column options), or a "
                    "shipped name such as cad:sentiment/dev")
    add_column_options(md)
    md.add_argument("--per-class", type=positive_int, default=100, help="samples per class, drawn from the control "
                    "set (class-balanced; more than it holds of a class is refused)")
    t = md.add_argument_group("treatment set", "The samples whose mean activations are patched in (class-balanced); "
                              "the control set is every other sample. One rule; default: --treatment-quantile for "
                              "text pairs (single texts need one of the others).")
    t.add_argument("--treatment", metavar="FILE", help="example ids of the samples, one per line (or a column 'id')")
    t.add_argument("--treatment-where", metavar="COLUMN=VALUE", help="the samples whose COLUMN (a column of the "
                   "--samples file) holds VALUE, compared as text")
    t.add_argument("--treatment-from-bias", metavar="DIR", help="a cat-fast bias fit output for the samples: the "
                   "rows whose bias probability of its predicted class is at least --bias-confidence")
    t.add_argument("--bias-confidence", type=float, default=0.8, help="--treatment-from-bias: the probability "
                   "threshold, in (0, 1]")
    t.add_argument("--treatment-quantile", type=float, default=0.95, help="text pairs: the pairs at or above this "
                   "quantile of hypothesis-word overlap")
    md.add_argument("--target-class", metavar="LABEL", help="label name (or index) of the model whose probability is "
                    "mediated (default: entailment, for a model with that label)")
    md.add_argument("--method", choices=("exact", "first-order"), default="exact",
                    help="exact batched sweep, or the first-order estimate (one backward)")
    md.add_argument("--layers", type=positive_int, nargs="+", help="layers to sweep (default: all)")
    md.add_argument("--components", nargs="+", help="components to sweep (default: all six)")
    md.add_argument("--top-k", type=positive_int, help="top neurons listed (default: 700 of 82,944, scaled)")
    md.add_argument("--max-length", type=positive_int, default=128, help="tokens per example (truncation)")
    md.add_argument("--seed", type=seed_int, default=0, help=f"seed of the class-balanced draws (0 to {SEED_MAX})")
    md.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    md.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    md.add_argument("--out", required=True, metavar="DIR", help="output directory (nie.pt, nie_summary.tsv, "
                    "top_neurons.tsv, top_neurons.png, mediation.json)")
    md.add_argument("--overwrite", action="store_true", help="replace an existing --out that cat-fast wrote")
    _add_mask(sub)
    _add_unlearn(sub, fmt)


def _add_mask(sub) -> None:
    mk = sub.add_parser("mask", help="mask the top neurons of a mediation analysis", formatter_class=_RecipeFormatter,
                        description="Write a copy of --model with the top neurons of --nie masked at the first token "
                                    "(load it with cat_fast.analysis.masking.load_masked; cat-fast eval applies it). "
                                    "--select-k chooses how many on data (see `python -m pydoc "
                                    "cat_fast.cli.k_select`).", epilog=MASK_RECIPE)
    mk.add_argument("--model", required=True, metavar="DIR", help="the classifier the analysis was run on")
    mk.add_argument("--nie", required=True, metavar="DIR", help="a cat-fast mediation output (or its nie.pt)")
    mk.add_argument("--top-k", type=positive_int, help="neurons to mask (default: the analysis' top-k)")
    mk.add_argument("--factor", type=float, default=0.0, help="activation scale in [0, 1] (0: hard mask)")
    mk.add_argument("--random-neurons", action="store_true", help="the paper's control: --top-k neurons drawn at "
                    "random (with --seed) instead of the top ones")
    mk.add_argument("--seed", type=seed_int, default=0, help=f"seed of --random-neurons (0 to {SEED_MAX})")
    mk.add_argument("--rescale", action="store_true", help="the paper's inverted-dropout form: the component's other "
                    "first-token activations times 1/p (p: the fraction left unmasked)")
    s = mk.add_argument_group("choosing k on data (--select-k)", "Mask the top k of each grid point in turn, score "
                              "each on held-out data, and keep the k the rule picks (k_selection.json: the curve, "
                              "the rule, the chosen k). The files are read as cat-fast eval reads them (the "
                              "checkpoint's columns, or the column options).")
    s.add_argument("--select-k", action="store_true", help="choose k on data instead of --top-k")
    s.add_argument("--k-grid", metavar="K,K,...", help="k to try: percentages of the neurons swept (0.5%%) or "
                   "numbers; k = 0 (unmasked) is always scored (None: 0.25%%,0.5%%,1%%,2%%,4%%,8%%)")
    s.add_argument("--k-rule", metavar="RULE", help="max-drop:D (the largest k whose accuracy on --select-dev stays "
                   "within D points of the unmasked model's, for it and every smaller k; None: max-drop:3) or "
                   "best-on:FILE (the best accuracy on FILE, the smallest k on ties)")
    s.add_argument("--select-dev", metavar="FILE", help="a held-out dev set that carries the bias (needed by "
                   "max-drop; scored too with best-on)")
    s.add_argument("--k-refine", type=nonneg_int, metavar="N", help="max-drop: bisect the gap between the k the grid "
                   "picks and the next k of the grid N times (each one more masked model scored), so that k is the "
                   "largest within the drop to 1/2^N of that gap; 0: the grid's k (None: 3)")
    add_column_options(mk)
    s.add_argument("--max-length", type=positive_int, help="tokens per example (None: the checkpoint's)")
    s.add_argument("--batch-size", type=positive_int, default=64, help="examples per scoring batch")
    s.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    mk.add_argument("--out", required=True, metavar="DIR", help="output model directory")
    mk.add_argument("--overwrite", action="store_true", help="replace an existing --out that cat-fast wrote")


def _add_unlearn(sub, fmt) -> None:
    ul = sub.add_parser("unlearn", help="gradient unlearning of the top neurons of a mediation analysis",
                        formatter_class=fmt, description="Train only the weight rows producing the top neurons of "
                        "--nie, with the gradient reversed, on the advantaged training examples (--bias right, the "
                        "model wrong); every other parameter stays bit-identical. Writes a model directory. No "
                        "--select-k here (each k would be a training run): choose k with mask --select-k.")
    ul.add_argument("--model", required=True, metavar="DIR", help="the classifier the analysis was run on")
    ul.add_argument("--nie", required=True, metavar="DIR", help="a cat-fast mediation output (or its nie.pt)")
    ul.add_argument("--task", choices=("sentiment", "nli"), help="built-in CAD training data")
    ul.add_argument("--train", nargs="+", metavar="FILE", help="training data (default with --task: built-in)")
    add_column_options(ul)
    ul.add_argument("--bias", required=True, metavar="FILE", help="the bias model's predictions (cat-fast bias fit)")
    ul.add_argument("--top-k", type=positive_int, help="neurons to unlearn (default: the analysis' top-k)")
    ul.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate of the ascent steps")
    ul.add_argument("--epochs", type=positive_int, default=15, help="passes over the training data (released code: 15)")
    ul.add_argument("--batch-size", type=positive_int, default=32, help="examples per batch (released code: 32)")
    ul.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (released code: 0.1)")
    ul.add_argument("--examples", choices=("advantaged", "random", "all"), default="advantaged",
                    help="advantaged: the bias model right and the model wrong (chosen once, before the first step); "
                    "random: as many examples drawn at random (the paper's control); all: every example")
    ul.add_argument("--random-neurons", action="store_true", help="the paper's control: --top-k neurons drawn at "
                    "random (with --seed) instead of the top ones")
    ul.add_argument("--candidate-class", metavar="LABEL", help="advantaged examples of this gold class only (the "
                    "released code: entailment for NLI); default: every class (the paper's text)")
    ul.add_argument("--max-length", type=positive_int, default=128, help="tokens per example (truncation)")
    ul.add_argument("--seed", type=seed_int, default=0, help=f"seed of the batch order and of the random draws (0 to "
                    f"{SEED_MAX})")
    ul.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    ul.add_argument("--out", required=True, metavar="DIR", help="output model directory")
    ul.add_argument("--overwrite", action="store_true", help="replace an existing --out that cat-fast wrote")
