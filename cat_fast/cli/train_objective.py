"""The objective's side of ``cat-fast train``, made from its declarations (`cat_fast.objectives.ObjectiveConfig`):
the method flags (one group per config, each option's flag, default, help and choices), their range checks, the
record of the options saved with every output, and ``--objective-config``, which repeats a saved record."""
from __future__ import annotations

import argparse
import json
import math
import os
from typing import Dict, List, Set

from .common import CHECKPOINT_META, CliError

__all__ = ["FLOAT_OPTIONS", "method_options", "add_objective_options", "check_options", "objective_record",
           "load_objective_config", "apply_objective_config", "pop_given", "GIVEN"]

# the Trainer's and LoRA's numbers: option dest -> (flag, lowest allowed, open at the low end); the objectives' own
# come from their configs (`method_options`)
FLOAT_OPTIONS = {
    "lr": ("--lr", 0.0, False), "weight_decay": ("--weight-decay", 0.0, False),
    "lr_warmup_ratio": ("--lr-warmup-ratio", 0.0, False), "max_grad_norm": ("--max-grad-norm", 0.0, False),
    "lora_alpha": ("--lora-alpha", 0.0, True), "lora_dropout": ("--lora-dropout", 0.0, False),
}
GIVEN = "_objective_options_given"  # the namespace attribute listing the method flags given on the command line
RECORD_FILES = ("metrics.json", CHECKPOINT_META, "cat_fast_run.json")  # files that hold an ``objective`` record


def method_options() -> Dict[str, List]:
    """Config title -> its options not declared by an earlier config (a flag shared by two methods, such as
    --gs-weight, appears once), over every registered objective, plugins included."""
    from .. import objectives

    configs = objectives.configs()
    groups, seen = {}, set()
    for name, config in configs.items():
        fresh = [o for o in config.options() if o.name not in seen]
        seen.update(o.name for o in fresh)
        if fresh:
            users = [n for n, c in configs.items() if c is config]
            groups.setdefault(f"{config.title or name} ({', '.join(users)})", []).extend(fresh)
    return groups


class _Given(argparse.Action):
    """Stores the value and notes that the flag was given (its value then wins over ``--objective-config``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        given = set(getattr(namespace, GIVEN, None) or ())
        given.add(self.dest)
        setattr(namespace, GIVEN, given)


class _GivenBool(argparse.BooleanOptionalAction):
    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        setattr(namespace, GIVEN, set(getattr(namespace, GIVEN, None) or ()) | {self.dest})


def add_objective_options(parser) -> None:
    """The method flags, generated from the registered objectives' configs."""
    head = parser.add_argument_group("objective options", "each method's flags below come from its config "
                                     "(cat_fast.objectives.ObjectiveConfig); a method reads its own and ignores the "
                                     "others'")
    head.add_argument("--objective-config", metavar="FILE|DIR", help="repeat a run's objective options: a "
                        "metrics.json, a model directory's cat_fast.json or a checkpoint folder's cat_fast_run.json, "
                        "or a directory holding one (a previous --out); saved for the same --method; the method flags "
                        "given on the command line win")
    for title, options in method_options().items():
        group = parser.add_argument_group(title)
        for o in options:
            if o.type is bool:
                group.add_argument(o.flag, dest=o.name, action=_GivenBool, default=o.default, help=o.help)
                continue
            group.add_argument(o.flag, dest=o.name, action=_Given, type=o.type, default=o.default, choices=o.choices,
                               metavar=o.metavar, help=o.help)


def check_options(args) -> None:
    """Every number finite and in its range (the Trainer's, and each objective option's from its config), the
    weight decay one that AdamW can apply, the logging integrations known and installed (one-line errors naming the
    option)."""
    from ..objectives.config import range_error

    for dest, (flag, low, open_low) in FLOAT_OPTIONS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if not math.isfinite(value) or (low is not None and (value < low or (open_low and value == low))):
            where = "" if low is None else (f" > {low:g}" if open_low else f" >= {low:g}")
            raise CliError(f"{flag} must be a finite number{where}, got {value}")
    for options in method_options().values():
        for o in options:
            problem = range_error(o, getattr(args, o.name, None))
            if problem:
                raise CliError(f"{o.flag} {problem}")
    _check_trainer_options(args)


def _check_trainer_options(args) -> None:
    from transformers.training_args import OptimizerNames

    names = [o.value for o in OptimizerNames]
    if args.optim not in names:
        raise CliError(f"--optim: expected one of the Trainer's optimizers ({', '.join(names[:6])}, ...), got "
                       f"{args.optim!r}")
    if getattr(args, "lora_dropout", 0.0) >= 1:
        raise CliError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    if args.lr_warmup_ratio > 1:
        raise CliError(f"--lr-warmup-ratio must be in [0, 1], got {args.lr_warmup_ratio}")
    if args.lr * args.weight_decay >= 1:  # AdamW's decoupled decay scales the weights by 1 - lr * weight_decay
        raise CliError(f"--weight-decay {args.weight_decay:g} with --lr {args.lr:g}: AdamW scales the weights by "
                       f"1 - lr x weight_decay = {1 - args.lr * args.weight_decay:g} each step; expected --lr x "
                       f"--weight-decay < 1")
    names = list(getattr(args, "report_to", None) or [])
    if names and names not in (["none"], ["all"]):
        from transformers.integrations import integration_utils as hf

        known = list(hf.INTEGRATION_TO_CALLBACK)
        unknown = [n for n in names if n not in known]
        if unknown:
            raise CliError(f"--report-to: {unknown[0]!r} is not a logging integration of the Hugging Face Trainer; "
                           f"expected 'none' or 'all' alone, or names among {', '.join(known)}")
        installed = hf.get_available_reporting_integrations()
        missing = [n for n in names if n not in installed]
        if missing:
            raise CliError(f"--report-to: {missing[0]} is not available (its package is not installed); installed "
                           f"integrations: {', '.join(installed) or 'none'}")


def objective_record(entry, args) -> Dict:
    """What a run saves of its objective: the method, its class and its config's values."""
    cls = entry.cls
    return {"method": entry.name, "class": f"{cls.__module__}.{cls.__qualname__}",
            "options": cls.options_of(vars(args))}


def load_objective_config(path: str) -> Dict:
    """The ``objective`` record in `path` (a file of `RECORD_FILES`' kind, or a directory holding one)."""
    where = path
    if os.path.isdir(path):
        found = [os.path.join(path, f) for f in RECORD_FILES if os.path.isfile(os.path.join(path, f))]
        if not found:
            raise CliError(f"--objective-config {path}: no {', '.join(RECORD_FILES)} in it (a previous --out holds "
                           "metrics.json)")
        where = found[0]
    try:
        with open(where, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError) as error:
        raise CliError(f"--objective-config {path}: cannot read it as JSON ({type(error).__name__})") from None
    record = saved.get("objective") if isinstance(saved, dict) else None
    if not (isinstance(record, dict) and isinstance(record.get("method"), str)
            and isinstance(record.get("options"), dict)):
        raise CliError(f"--objective-config {path}: {os.path.basename(where)} holds no objective record (an "
                       "'objective' with 'method' and 'options', written by cat-fast train)")
    return record


def pop_given(args) -> Set[str]:
    """The method flags given on the command line (removed from `args`, which the outputs record)."""
    given = set(getattr(args, GIVEN, None) or ())
    if hasattr(args, GIVEN):
        delattr(args, GIVEN)
    return given


def apply_objective_config(args, given: Set[str]) -> None:
    """``--objective-config``: the saved options into `args`, except those `given` on the command line."""
    path = getattr(args, "objective_config", None)
    if not path:
        return
    record = load_objective_config(path)
    if record["method"] != args.method:
        raise CliError(f"--objective-config {path}: saved for --method {record['method']}, not --method "
                       f"{args.method}")
    options = {o.name: o for opts in method_options().values() for o in opts}
    for name, value in record["options"].items():
        if name in given or name not in options:
            continue
        kind = options[name].type
        if isinstance(value, list) and callable(kind) and kind not in (list, tuple):
            value = kind(value)  # a JSON list back to the option's value (layers, a pair)
        setattr(args, name, value)
