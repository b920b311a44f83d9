"""What an objective declares, so that nothing above it needs its name (docs/STYLE.md "A method declares what it
needs"):

- ``config``: a dataclass of its options (`ObjectiveConfig`, fields made with `option`: default, range, help, flag).
  The CLI makes its flags, their checks and help from it; a run saves it with every checkpoint and can be repeated
  from it (``cat-fast train --objective-config``).
- ``requires``: the `Requirement` s its batches or constructor need (`PAIRS`, `BIAS`, `TEACHER`, `METADATA`, or
  one of the plugin's own). Their ``columns`` are the batch keys that are not the model's inputs: the Trainer keeps
  them in the batch, `models.model_inputs` leaves them out; the CLI provides each requirement through one handler
  per ``kind``.
- ``curves``: the `Curve` s of its ``info`` that the CLI's ``curves.png`` draws.

    @dataclass
    class MyConfig(ObjectiveConfig):
        title = "my-method"
        strength: float = option(1.0, low=0.0, help="weight of the extra term")

    class Mine(Objective):
        config = MyConfig
        requires = (PAIRS,)
        curves = (Curve("extra_loss", "extra part", after_warmup=True),)
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from typing import ClassVar, Dict, List, Mapping, Optional, Tuple

__all__ = ["option", "ObjectiveConfig", "Requirement", "PAIRS", "BIAS", "TEACHER", "METADATA", "CONTEXT_MASK",
           "DIAGNOSTIC_GROUPS", "Curve",
           "Declarations", "Option", "missing_arguments", "range_error", "int_list", "float_pair", "count"]


# ---------------------------------------------------------------------------------------------- option values


def int_list(s: str) -> List[int]:
    """``M,M,...``: layer numbers >= 1 (e.g. CAT's mixing layers)."""
    if isinstance(s, (list, tuple)):
        s = ",".join(map(str, s))
    try:
        out = [int(x) for x in str(s).replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers such as 4,5, got {s!r}")
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers >= 1 such as 4,5, got {s!r}")
    return out


def float_pair(s: str) -> Tuple[float, float]:
    """``A,B`` as two finite numbers with A <= B (e.g. the CRM clip range 0.9,2)."""
    if isinstance(s, (list, tuple)):
        s = ",".join(map(str, s))
    try:
        a, b = (float(x) for x in str(s).replace(" ", "").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two comma-separated numbers such as 0.9,2, got {s!r}")
    if not (math.isfinite(a) and math.isfinite(b)) or a > b:
        raise argparse.ArgumentTypeError(f"expected two finite numbers A,B with A <= B such as 0.9,2, got {s!r}")
    return a, b


def count(s) -> int:
    """A non-negative integer."""
    try:
        v = int(s)
    except (TypeError, ValueError):
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {s!r}")
    return v


def option(default=None, *, low=None, high=None, low_open: bool = False, help: str = "", flag: Optional[str] = None,
           type=None, choices=None, metavar: Optional[str] = None):
    """A field of an `ObjectiveConfig`: its `default`, its range (``low`` / ``high``, ``low_open``: low excluded;
    numbers only), its `help`, and the command-line flag (default ``--`` + the name with dashes). `type` parses a
    command-line string (default: the type of `default`, str when None); `choices` lists the values allowed."""
    meta = dict(low=low, high=high, low_open=low_open, help=help, flag=flag, type=type, choices=choices,
                metavar=metavar)
    return field(default=default, metadata={"cat_fast": meta})


@dataclass(frozen=True)
class Option:
    """One option of a config as the CLI sees it (`ObjectiveConfig.options`)."""

    name: str
    flag: str
    default: object
    help: str
    type: object
    choices: Optional[tuple]
    metavar: Optional[str]
    low: Optional[float]
    high: Optional[float]
    low_open: bool


def range_error(option: Option, value) -> Optional[str]:
    """What is wrong with `value` for a numeric `option` with a range ("must be a finite number >= 0, got -1"), or
    None (in range, not a number, or None)."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    low, high = option.low, option.high
    if low is None and high is None and not isinstance(option.default, float) and option.type is not float:
        return None
    bad = not math.isfinite(value) or (low is not None and (value < low or (option.low_open and value == low))) or (
        high is not None and value > high)
    if not bad:
        return None
    if high is not None:
        where = f" in {'(' if option.low_open else '['}{'-inf' if low is None else f'{low:g}'}, {high:g}]"
    else:
        where = "" if low is None else (f" > {low:g}" if option.low_open else f" >= {low:g}")
    return f"must be a finite number{where}, got {value}"


@dataclass
class ObjectiveConfig:
    """Base of the objectives' configs (module docstring): a dataclass whose fields are `option` s, named as the
    command line's destinations (``alpha``, ``cat_layers``)."""

    title: ClassVar[str] = ""  # the heading of its flags in ``cat-fast train --help``

    @classmethod
    def options(cls) -> List[Option]:
        out = []
        for f in dataclasses.fields(cls):
            meta = f.metadata.get("cat_fast", {})
            default = f.default if f.default is not dataclasses.MISSING else None
            kind = meta.get("type") or (type(default) if default is not None else str)
            out.append(Option(f.name, meta.get("flag") or "--" + f.name.replace("_", "-"), default,
                              meta.get("help", ""), kind, tuple(meta["choices"]) if meta.get("choices") else None,
                              meta.get("metavar"), meta.get("low"), meta.get("high"), bool(meta.get("low_open"))))
        return out

    @classmethod
    def from_options(cls, options: Mapping) -> "ObjectiveConfig":
        """The config from flat `options` (the CLI's ``vars(args)``, a saved config): each field's value where
        `options` has it, its default where not."""
        return cls(**{o.name: _plain(options[o.name]) for o in cls.options() if o.name in options})

    def check(self) -> None:
        """A ValueError naming the first field out of its range."""
        for o in self.options():
            problem = range_error(o, getattr(self, o.name))
            if problem:
                raise ValueError(f"{o.name}: {problem.replace('must be', 'expected', 1)}")

    def to_dict(self) -> Dict:
        """The fields as JSON values (tuples as lists)."""
        return {o.name: _plain(getattr(self, o.name)) for o in self.options()}


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


# ---------------------------------------------------------------------------------------------- requirements


@dataclass(frozen=True)
class Requirement:
    """What an objective needs besides the model's inputs and labels: batch ``columns`` (kept by the Trainer, left
    out of the model's forward), constructor ``arguments`` (name -> what it is, said when missing), and a ``kind``
    that the CLI provides through one handler. ``optional``: read when present (nothing to provide)."""

    kind: str
    columns: Tuple[str, ...] = ()
    arguments: Tuple[Tuple[str, str], ...] = ()
    help: str = ""
    optional: bool = False


PAIRS = Requirement("pairs", ("pairs", "pair_group"), help="counterfactual pairs: a partner's index in the batch "
                    "(pairs) or a group id per example (pair_group)")
BIAS = Requirement("bias", ("bias",), help="a bias model's log-probabilities per example [B, C]")
TEACHER = Requirement("teacher", ("teacher_probs",), help="a teacher's probabilities per example [B, C]")
METADATA = Requirement("metadata", arguments=(("meta_batches", "meta_batches=[...]: a small balanced metadata set as "
                                                               "tokenised batches, dicts of model inputs + labels"),),
                       help="a small balanced metadata set")
CONTEXT_MASK = Requirement("context_mask", ("context_mask",), help="question answering: the tokens that may be mixed",
                           optional=True)
DIAGNOSTIC_GROUPS = Requirement("groups", ("diagnostic_group",), help="a group id per example (0..G-1) that "
                                "diagnostics are broken down by (e.g. a planted cue)", optional=True)


@dataclass(frozen=True)
class Curve:
    """An ``info`` key drawn in ``curves.png``: on the ``"loss"`` panel beside the loss, or on a panel of its own
    name; ``after_warmup``: not drawn during an ERM warm-up (the term is 0 there)."""

    key: str
    label: str
    panel: str = "loss"
    after_warmup: bool = False


class _Needs:
    """``needs_<kind>``: derived from ``requires`` (read by code written before the declarations)."""

    def __init__(self, kind):
        self.kind = kind

    def __get__(self, obj, cls):
        return any(r.kind == self.kind and not r.optional for r in cls.requires)


class Declarations:
    """The declarations of an objective (module docstring), inherited by `Objective`."""

    config: ClassVar[type] = ObjectiveConfig  # its options
    requires: ClassVar[tuple] = ()  # its `Requirement` s
    curves: ClassVar[tuple] = ()  # its `Curve` s
    distributed_preset: ClassVar[dict] = {}  # arguments it takes when it trains under DistributedDataParallel
    random_pairs = False  # it draws its own partners: `PAIRS` optional in the batch
    needs_pairs = _Needs("pairs")
    needs_bias = _Needs("bias")
    needs_teacher = _Needs("teacher")
    needs_meta = _Needs("metadata")

    @classmethod
    def batch_columns(cls) -> tuple:
        """The batch keys of its requirements."""
        return tuple(dict.fromkeys(c for r in cls.requires for c in r.columns))


def missing_arguments(cls, given: Mapping) -> Optional[str]:
    """What ``cls`` (an objective class) needs that `given` lacks: each argument of its ``__init__`` after the model
    without a default, described by its requirements' ``arguments`` where they declare it; None when nothing."""
    described = dict(a for r in getattr(cls, "requires", ()) for a in r.arguments)
    described.update(getattr(cls, "required_help", {}))
    parameters = list(inspect.signature(cls.__init__).parameters.values())[2:]  # after self and the model
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    missing = [p.name for p in parameters if p.kind in kinds and p.default is p.empty and p.name not in given]
    if not missing:
        return None
    needs = "; ".join(described.get(n, f"{n}=...") for n in missing)
    passed = ", ".join(f"{n!r}: ..." for n in missing)
    return (f"{cls.__name__} needs {needs} (objective_kwargs={{{passed}}} in the Trainer classes, keyword arguments "
            "of build)")
