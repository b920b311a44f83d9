"""Argument types and option groups shared by the commands' parsers (`cat_fast.cli.parse_*`)."""
from __future__ import annotations

import argparse
import math

__all__ = ["scheduler_types", "method_names", "add_column_options", "label_names", "SEED_MAX", "seed_int",
           "positive_float", "float_in"]


def scheduler_types():
    from transformers.trainer_utils import SchedulerType

    return [t.value for t in SchedulerType if t.value not in ("reduce_lr_on_plateau", "greedy")]


def method_names():
    from ..objectives import names  # imports torch and transformers: only when the parser is built

    return names()


def add_column_options(parser) -> None:
    c = parser.add_argument_group("your own data", "Instead of --task: CSV, TSV, JSON Lines or a JSON array, a "
                                  "save_to_disk directory, a local Hugging Face dataset folder or a hub dataset's name (NAME, "
                                  "ORG/NAME[:CONFIG]) read offline from the local datasets cache; PATH@SPLIT chooses a "
                                  "split. "
                                  "Columns not given are found by name: text / sentence / review, sentence1 + "
                                  "sentence2, premise + hypothesis, question + sentence; label / labels.")
    c.add_argument("--text-column", metavar="NAME", help="column of the text (the premise for text pairs)")
    c.add_argument("--text-pair-column", metavar="NAME", help="column of the second text of a pair (the hypothesis)")
    c.add_argument("--label-column", metavar="NAME", help="column of the label (strings or integers)")
    c.add_argument("--group-column", metavar="NAME", help="rows with the same value are counterfactuals of each other "
                   "(the first in the file is the original); needed by gs and gs-random")
    c.add_argument("--id-column", metavar="NAME", help="column of an example id (default: the row number)")
    c.add_argument("--labels", type=label_names, metavar="A,B,...", help="the label set, in id order (default: every label "
                   "in the training file, integers in numeric order, names in alphabetical order)")


def label_names(s: str):
    names = [x.strip() for x in s.split(",") if x.strip()]
    if len(names) < 2 or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected at least two distinct comma-separated labels, got {s!r}")
    return names


SEED_MAX = 2**32 - 1  # numpy's seeds (the Trainer seeds numpy with --seed)


def seed_int(s: str) -> int:
    try:
        value = int(s)
    except ValueError:
        value = -1
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, {SEED_MAX}], got {s!r}")
    return value


def positive_float(s: str) -> float:
    try:
        value = float(s)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {s!r}")
    return value


def float_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False):
    """An argparse type: a number in the interval from `low` to `high` (each end closed unless ``*_open``), else
    "expected a number in [low, high], got ..."."""
    where = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(s: str) -> float:
        try:
            value = float(s)
        except ValueError:
            value = math.nan
        inside = (low < value if low_open else low <= value) and (value < high if high_open else value <= high)
        if not inside:
            raise argparse.ArgumentTypeError(f"expected a number in {where}, got {s!r}")
        return value

    return parse
