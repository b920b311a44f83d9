"""``cat-fast bias``'s options."""
from __future__ import annotations

import argparse

from .arguments import add_column_options, positive_float, seed_int
from .common import Parser, positive_int

__all__ = ["add_bias", "KINDS"]

KINDS = ("overlap", "column", "features", "weak-learner")


def column_names(s: str):
    names = [x.strip() for x in s.split(",") if x.strip()]
    if not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct comma-separated column names such as genre,length, "
                                         f"got {s!r}")
    return names


def at_least_two(s: str) -> int:
    try:
        value = int(s)
    except ValueError:
        value = 0
    if value < 2:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2, got {s!r}")
    return value


def gce_q(s: str) -> float:
    try:
        value = float(s)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {s!r}")
    return value


def add_bias(sub, fmt) -> None:
    """Add the ``bias fit`` command to the `cat-fast` subparsers `sub` (help formatter `fmt`)."""
    bias = sub.add_parser("bias", help="bias models for the bias-model methods", formatter_class=fmt,
                          description="Bias models (see `python -m pydoc cat_fast.cli.bias`).")
    bsub = bias.add_subparsers(dest="bias_command", metavar="{fit}", parser_class=Parser)
    bsub.required = True
    f = bsub.add_parser("fit", help="write a bias model's predictions for the training examples", formatter_class=fmt,
                        description="Fit a bias model on the training data and write its per-example "
                                    "log-probabilities to DIR/bias.jsonl (for train --bias DIR).")
    f.add_argument("--kind", required=True, choices=KINDS,
                   help="overlap: word-overlap features + logistic regression (NLI); column: a classifier trained on "
                        "one column (--model); features: the label given columns of the file (--feature-columns); "
                        "weak-learner: a small classifier fine-tuned on a small subset (an unknown bias)")
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
    # the options of one kind are absent from the namespace unless given (cli/bias.py refuses them for other kinds)
    g = f.add_argument_group("--kind features", argument_default=argparse.SUPPRESS)
    g.add_argument("--feature-columns", type=column_names, metavar="A,B,...",
                   help="columns of the training file (categorical, or numbers)")
    g.add_argument("--categorical-columns", type=column_names, metavar="A,B,...",
                   help="feature columns of numbers to treat as categories")
    g.add_argument("--model-type", choices=("exact", "logistic"),
                   help="exact: the smoothed conditional p(y | values) (categorical columns); logistic: one-hot "
                        "categories + numbers, standardised (default: exact when every column is categorical)")
    g.add_argument("--smoothing", type=positive_float, metavar="ALPHA",
                   help="exact: additive smoothing of the counts (default 1)")
    g.add_argument("--class-weight", choices=("none", "balanced"),
                   help="logistic: class weights (default none; overlap uses balanced)")
    f.add_argument("--C", type=positive_float, default=100.0, help="--kind overlap and features (logistic): inverse "
                   "L2 strength (Clark's C; a finite number > 0)")
    w = f.add_argument_group("--kind weak-learner and column", argument_default=argparse.SUPPRESS)
    w.add_argument("--model", metavar="DIR", help="column: the classifier trained on that column; weak-learner: the "
                   "classifier to fine-tune (default minilm)")
    f.add_argument("--column", default="text_pair", help="--kind column: the column it reads (text, text_pair or a "
                   "column name)")
    w.add_argument("--subset", type=at_least_two, metavar="N",
                   help="weak-learner: examples drawn from the fitting rows (default 2000, or all when fewer)")
    w.add_argument("--epochs", type=positive_int, help="weak-learner: training epochs (default 3)")
    w.add_argument("--layers", type=positive_int, metavar="K",
                   help="weak-learner: keep only the first K encoder layers (default all)")
    w.add_argument("--lr", type=positive_float, help="weak-learner: AdamW learning rate (default 5e-5)")
    w.add_argument("--max-length", type=at_least_two, help="weak-learner: tokens per example (default 128)")
    w.add_argument("--weak-loss", choices=("ce", "gce"),
                   help="weak-learner: its training loss. gce (the default): generalized cross-entropy "
                        "(1 - p_y^q)/q, whose gradient weighs each row by p_y^q, so the rows the learner already "
                        "fits (those of the feature it learns first, often a shortcut) outweigh the rows against "
                        "it and it stays with that feature; ce: cross-entropy, which can go on from that feature "
                        "to the task itself within the default epochs (a bias model that knows the task leaves the "
                        "bias-model methods nothing to learn)")
    w.add_argument("--gce-q", type=gce_q, metavar="Q", help="weak-learner, --weak-loss gce: q in (0, 1] (towards "
                   "0: cross-entropy; 1: mean absolute error; default 0.7)")
    f.add_argument("--batch-size", type=positive_int, default=32, help="--kind column and weak-learner: examples "
                   "per batch")
    f.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    f.add_argument("--out", required=True, metavar="DIR", help="output directory (bias.jsonl, bias_meta.json)")
    f.add_argument("--overwrite", action="store_true", help="replace an existing --out that cat-fast wrote")
