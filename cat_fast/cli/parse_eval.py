"""``cat-fast eval`` and ``cat-fast predict``'s options."""
from __future__ import annotations

from .arguments import add_column_options
from .common import positive_int

__all__ = ["add_eval"]


def add_eval(sub, fmt) -> None:
    """Add the ``eval`` and ``predict`` commands to the `cat-fast` subparsers `sub` (help formatter `fmt`)."""
    e = sub.add_parser("eval", help="evaluate a trained classifier", formatter_class=fmt,
                       description="Evaluate a checkpoint written by `cat-fast train`.")
    e.add_argument("--model", required=True, metavar="DIR", help="a checkpoint directory")
    e.add_argument("--task", choices=("sentiment", "nli"), help="default: the data the checkpoint was trained on")
    e.add_argument("--eval", nargs="+", action="extend", metavar="NAME=FILE", default=[],
                   help="evaluation sets (with a CAD task the built-in dev set is always scored too, as dev, dev_orig, "
                   "dev_edit; `hans`: the shipped HANS-style set)")
    add_column_options(e)
    e.add_argument("--max-length", type=positive_int, help="default: the checkpoint's training max length, else 128")
    e.add_argument("--eval-batch-size", type=positive_int, default=64, help="examples per batch")
    e.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    e.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    e.add_argument("--out", metavar="DIR", help="write DIR/metrics.json (default: print JSON)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing --out that cat-fast wrote")
    pr = sub.add_parser("predict", help="every example's prediction and class probabilities", formatter_class=fmt,
                        description="Write a checkpoint's predicted label and class probabilities for every example "
                                    "of --data, with its gold label when the data has one (see `python -m pydoc "
                                    "cat_fast.cli.predict`).")
    pr.add_argument("--model", required=True, metavar="DIR", help="a checkpoint directory")
    pr.add_argument("--data", required=True, metavar="FILE", help="the examples, read as `cat-fast eval` reads "
                    "them (a label column is optional)")
    pr.add_argument("--task", choices=("sentiment", "nli"), help="CAD-format --data (default: the data the "
                    "checkpoint was trained on)")
    add_column_options(pr)
    pr.add_argument("--max-length", type=positive_int, help="default: the checkpoint's training max length, else 128")
    pr.add_argument("--eval-batch-size", type=positive_int, default=64, help="examples per batch")
    pr.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    pr.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    pr.add_argument("--out", required=True, metavar="FILE", help="FILE.csv (columns id, prediction, prob_LABEL..., "
                    "gold) or FILE.jsonl (id, prediction, probs, gold)")
    pr.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
