"""``cat-fast bias``'s options."""
from __future__ import annotations

from .arguments import add_column_options, positive_float
from .common import Parser, positive_int

__all__ = ["add_bias"]


def add_bias(sub, fmt) -> None:
    """Add the ``bias fit`` command to the `cat-fast` subparsers `sub` (help formatter `fmt`)."""
    bias = sub.add_parser("bias", help="bias models for the bias-model methods", formatter_class=fmt,
                          description="Bias models (see `python -m pydoc cat_fast.cli.bias`).")
    bsub = bias.add_subparsers(dest="bias_command", metavar="{fit}", parser_class=Parser)
    bsub.required = True
    f = bsub.add_parser("fit", help="write a bias model's predictions for the training examples", formatter_class=fmt,
                        description="Fit a bias model on the training data and write its per-example "
                                    "log-probabilities to DIR/bias.jsonl (for train --bias DIR).")
    f.add_argument("--kind", required=True, choices=("overlap", "column"),
                   help="overlap: word-overlap features + logistic regression (NLI); column: a classifier trained on "
                        "one column (--model)")
    f.add_argument("--task", choices=("sentiment", "nli"), help="built-in CAD data (or CAD-format --train files)")
    f.add_argument("--train", nargs="+", metavar="FILE", help="training data (default with --task: the built-in "
                   "CAD train split)")
    add_column_options(f)
    f.add_argument("--model", metavar="DIR", help="--kind column: the classifier trained on that column")
    f.add_argument("--column", default="text_pair", help="--kind column: the column it reads (text, text_pair or a "
                   "column name)")
    f.add_argument("--C", type=positive_float, default=100.0, help="--kind overlap: inverse L2 strength (Clark's C; "
                   "a finite number > 0)")
    f.add_argument("--batch-size", type=positive_int, default=64, help="--kind column: examples per batch")
    f.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    f.add_argument("--out", required=True, metavar="DIR", help="output directory (bias.jsonl, bias_meta.json)")
    f.add_argument("--overwrite", action="store_true", help="replace an existing --out that cat-fast wrote")
