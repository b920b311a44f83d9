"""``cat-fast mediation``, ``mask`` and ``unlearn``'s options."""
from __future__ import annotations

from .arguments import SEED_MAX, add_column_options, seed_int
from .common import positive_int

__all__ = ["add_mediation"]


def add_mediation(sub, fmt) -> None:
    """Add the ``mediation``, ``mask`` and ``unlearn`` commands to the `cat-fast` subparsers `sub` (help formatter `fmt`)."""
    md = sub.add_parser("mediation", help="the NIE of every neuron (causal mediation analysis)", formatter_class=fmt,
                        description="Causal mediation analysis of a trained NLI classifier's neurons (see `python -m "
                                    "pydoc cat_fast.cli.mediation`).")
    md.add_argument("--model", required=True, metavar="DIR", help="a trained classifier (cat-fast train --out DIR)")
    md.add_argument("--task", choices=("nli",), help="the built-in CAD NLI dev set as samples")
    md.add_argument("--samples", metavar="FILE", help="samples from your own file (with the column options)")
    add_column_options(md)
    md.add_argument("--per-class", type=positive_int, default=100, help="samples per class (class-balanced; more "
                    "than the samples hold of a class is refused)")
    md.add_argument("--treatment-quantile", type=float, default=0.95, help="treatment: pairs at or above this "
                    "quantile of hypothesis-word overlap")
    md.add_argument("--target-class", default="entailment", help="label name or index whose probability is mediated")
    md.add_argument("--method", choices=("exact", "first-order"), default="exact",
                    help="exact batched sweep, or the first-order estimate (one backward)")
    md.add_argument("--layers", type=positive_int, nargs="+", help="layers to sweep (default: all)")
    md.add_argument("--components", nargs="+", help="components to sweep (default: all six)")
    md.add_argument("--top-k", type=positive_int, help="top neurons listed (default: 700 of 82,944, scaled)")
    md.add_argument("--max-length", type=positive_int, default=128, help="tokens per pair (truncation)")
    md.add_argument("--seed", type=seed_int, default=0, help=f"seed of the class-balanced draws (0 to {SEED_MAX})")
    md.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    md.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    md.add_argument("--out", required=True, metavar="DIR", help="output directory (nie.pt, nie_summary.tsv, "
                    "top_neurons.tsv, top_neurons.png, mediation.json)")
    md.add_argument("--overwrite", action="store_true", help="replace an existing --out that cat-fast wrote")

    mk = sub.add_parser("mask", help="mask the top neurons of a mediation analysis", formatter_class=fmt,
                        description="Write a copy of --model with the top neurons of --nie masked at the first token "
                                    "(load it with cat_fast.analysis.masking.load_masked; cat-fast eval applies it).")
    mk.add_argument("--model", required=True, metavar="DIR", help="the classifier the analysis was run on")
    mk.add_argument("--nie", required=True, metavar="DIR", help="a cat-fast mediation output (or its nie.pt)")
    mk.add_argument("--top-k", type=positive_int, help="neurons to mask (default: the analysis' top-k)")
    mk.add_argument("--factor", type=float, default=0.0, help="activation scale in [0, 1] (0: hard mask)")
    mk.add_argument("--random-neurons", action="store_true", help="the paper's control: --top-k neurons drawn at "
                    "random (with --seed) instead of the top ones")
    mk.add_argument("--seed", type=seed_int, default=0, help=f"seed of --random-neurons (0 to {SEED_MAX})")
    mk.add_argument("--rescale", action="store_true", help="the paper's inverted-dropout form: the component's other "
                    "first-token activations times 1/p (p: the fraction left unmasked)")
    mk.add_argument("--out", required=True, metavar="DIR", help="output model directory")
    mk.add_argument("--overwrite", action="store_true", help="replace an existing --out that cat-fast wrote")

    ul = sub.add_parser("unlearn", help="gradient unlearning of the top neurons of a mediation analysis",
                        formatter_class=fmt, description="Train only the weight rows producing the top neurons of "
                        "--nie, with the gradient reversed, on the advantaged training examples (--bias right, the "
                        "model wrong); every other parameter stays bit-identical. Writes a model directory.")
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
