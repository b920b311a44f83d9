"""``cat-fast shortcut``'s options."""
from __future__ import annotations

import argparse

from .arguments import SEED_MAX, add_column_options, float_in, seed_int
from .common import Parser, positive_int

__all__ = ["add_shortcut"]


def cue_spec(s: str):
    from ..shortcuts import ShortcutError, parse_cue

    try:
        return parse_cue(s)
    except ShortcutError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


strength = float_in(0.5, 1.0)  # the cue's strength P
fraction = float_in(0.0, 1.0, low_open=True, high_open=True)  # a held-out share of the input


def add_shortcut(sub, fmt) -> None:
    """Add the ``shortcut plant`` command to the `cat-fast` subparsers `sub` (help formatter `fmt`)."""
    s = sub.add_parser("shortcut", help="benchmarks with a planted shortcut", formatter_class=fmt,
                       description="Planted shortcuts (see `python -m pydoc cat_fast.shortcuts.plant`).")
    ssub = s.add_subparsers(dest="shortcut_command", metavar="{plant}", parser_class=Parser)
    ssub.required = True
    p = ssub.add_parser("plant", help="write a dataset with a label-correlated cue and its anti / clean test sets",
                        formatter_class=fmt,
                        description="Plant a surface cue that predicts --cue-class in train and dev (strength P), "
                                    "is on every other class's rows in test_anti and on none in test_clean. Writes "
                                    "DIR/{train,train_clean,dev,test_anti,test_clean}.jsonl and DIR/shortcut.json.")
    p.add_argument("--task", choices=("sentiment", "nli"), help="built-in CAD data (or CAD-format --train files)")
    p.add_argument("--train", nargs="+", metavar="FILE", help="the labelled input, read as `cat-fast train --train` "
                   "reads it (default with --task: the built-in CAD train split)")
    p.add_argument("--dev", metavar="FILE", help="dev input (default: --dev-fraction of the --train rows, held out "
                   "by counterfactual group)")
    p.add_argument("--test", metavar="FILE", help="test input of test_anti and test_clean (default: --test-fraction "
                   "of the --train rows, held out by counterfactual group)")
    add_column_options(p)
    p.add_argument("--cue", required=True, type=cue_spec, metavar="SPEC",
                   help="token:WORD[@start|@end|@random], length[:N] (N filler sentences), punctuation ('!!' against "
                        "'.') or casing[:K] (the first K words upper-cased; 0: the whole text)")
    p.add_argument("--strength", required=True, type=strength, metavar="P",
                   help="train and dev: P(cue | y = --cue-class) = P, P(cue | other labels) = 1 - P (exact counts "
                        "per class); in [0.5, 1]")
    p.add_argument("--cue-class", metavar="LABEL", help="the label the cue predicts (default: the first label)")
    p.add_argument("--cue-field", choices=("text", "text_pair"), default="text",
                   help="the text the cue goes into (text_pair: the second text of a pair, e.g. the hypothesis)")
    p.add_argument("--dev-fraction", type=fraction, default=0.1, metavar="F",
                   help="rows of --train held out as dev without --dev")
    p.add_argument("--test-fraction", type=fraction, default=0.2, metavar="F",
                   help="rows of --train held out as the test sets without --test")
    p.add_argument("--max-length", type=positive_int, default=128, metavar="N",
                   help="the truncation length the data will be trained at: the texts are cut to it for a cue at the "
                        "end of the text (--fit-max-length), and one that still lies beyond N tokens of --model's "
                        "tokenizer on many rows is said, and counted in shortcut.json")
    p.add_argument("--fit-max-length", action=argparse.BooleanOptionalAction, default=True,
                   help="for a cue at the end of the text (punctuation, length, token:WORD@end): before the splits "
                        "are drawn, cut every input row's --cue-field after its last whole word that lets the row, "
                        "read by --model's tokenizer as the model reads it, fit in --max-length tokens with the cue's "
                        "longest ending (all splits alike, the clean ones included; rows that fit are kept whole). "
                        "--no-fit-max-length plants into the whole texts, where truncation may cut the cue. Ignored "
                        "for other cues (token:WORD@start or @random, casing)")
    p.add_argument("--model", default="minilm", help="the model whose tokenizer counts the tokens (as cat-fast train "
                   "--model)")
    p.add_argument("--seed", type=seed_int, default=0, help=f"seed of every draw (0 to {SEED_MAX})")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out that cat-fast wrote")
