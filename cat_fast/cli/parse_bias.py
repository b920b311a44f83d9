"""``cat-fast bias``'s options."""
from __future__ import annotations

from .arguments import add_column_options, seed_int
from .bias_kinds import KINDS, add_kind_options, kind_help
from .common import Parser, positive_int

__all__ = ["add_bias", "KINDS"]


def add_bias(sub, fmt) -> None:
    """Add the ``bias fit`` command to the `cat-fast` subparsers `sub` (help formatter `fmt`)."""
    bias = sub.add_parser("bias", help="bias models for the bias-model methods", formatter_class=fmt,
                          description="Bias models (see `python -m pydoc cat_fast.cli.bias`).")
    bsub = bias.add_subparsers(dest="bias_command", metavar="{fit}", parser_class=Parser)
    bsub.required = True
    f = bsub.add_parser("fit", help="write a bias model's predictions for the training examples", formatter_class=fmt,
                        description="Fit a bias model on the training data and write its per-example "
                                    "log-probabilities to DIR/bias.jsonl (for train --bias DIR).")
    f.add_argument("--kind", required=True, choices=KINDS, help=kind_help())
    f.add_argument("--task", choices=("sentiment", "nli"), help="built-in CAD data (or CAD-format --train files)")
    f.add_argument("--train", nargs="+", metavar="FILE", help="training data (default with --task: the built-in "
                   "CAD train split)")
    add_column_options(f)
    f.add_argument("--folds", type=positive_int, default=1, metavar="K",
                   help="cross-fitting: each row predicted by a model fitted on the other K-1 folds (counterfactual "
                        "groups kept in one fold); 1: in-sample. 5 is recommended for features and weak-learner")
    f.add_argument("--seed", type=seed_int, default=0, help="the fold split, the weak learner's subset and training")
    f.add_argument("--calibrate", choices=("none", "temperature"),
                   help="temperature: rescale the held-out predictions by one temperature fitted on them (needs "
                        "--folds K > 1), so that their confidence matches their accuracy; a fine-tuned weak learner "
                        "is over-confident, and a bias-model loss given p_bias(y) near 1 leaves the main model "
                        "nothing to learn (default: temperature for weak-learner with --folds K > 1, else none)")
    add_kind_options(f)  # each kind's options, as cli/bias_kinds.py declares them
    f.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    f.add_argument("--out", required=True, metavar="DIR", help="output directory (bias.jsonl, bias_meta.json)")
    f.add_argument("--overwrite", action="store_true", help="replace an existing --out that cat-fast wrote")
