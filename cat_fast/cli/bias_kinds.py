"""The kinds of ``cat-fast bias fit --kind``, each declared once (`BiasKind` in `BIAS_KINDS`): its help, its options
(`KindOption`: the flag and its argparse keywords, the help, the value it takes when not given or what the kind needs
it for) and its fitter. Everything else is derived from these declarations: the ``--kind`` choices (`KINDS`) and help
(`kind_help`), the parser's option groups, titled by the kinds that take each option (`add_kind_options`), and, before
a fit, the refusal of another kind's option and the defaults of the options not given (`resolve_kind_options`). An
option that two kinds take (``--model``, ``--batch-size``, ``--C``) is one flag listed by both, each with its own
help, default or need. Adding a kind is one entry here.

A fitter ``fit(args, train) -> (fit_rows, options, last)``: ``fit_rows(rows)`` fits a model on those training rows
and returns ``predict(held_rows)`` (log-probabilities); ``options`` is the record in ``bias_meta.json``; ``last``
receives the last fitted model's ``meta()`` under ``"model"``. The fitters import the models when they run, so this
module stays light to import.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from .arguments import float_in, positive_float
from .common import CliError, get_device, positive_int

__all__ = ["BiasKind", "KindOption", "BIAS_KINDS", "KINDS", "kind_options", "kind_help", "add_kind_options",
           "resolve_kind_options"]


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


gce_q = float_in(0.0, 1.0, low_open=True)  # q of generalized cross-entropy


@dataclass(frozen=True)
class KindOption:
    """An option of one kind: ``flag`` with its argparse keywords (``type``, ``metavar``, ``choices``); ``help``;
    ``default``, the value it takes when not given (None: none, or one the fitter works out, which ``default_text``
    says); ``needs``: the option must be given, and what for (the refusal's words)."""
    flag: str
    help: str = ""
    default: Any = None
    default_text: Optional[str] = None
    needs: Optional[str] = None
    argparse: Mapping[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def but(self, **changes) -> "KindOption":
        """The same flag as another kind takes it (its own help, default or need)."""
        return dataclasses.replace(self, **changes)

    def shown(self) -> str:
        """The help with the default (or the need) said."""
        if self.needs:
            return f"{self.help} (required)"
        text = self.default_text or _value_text(self.default)
        return f"{self.help} (default {text})" if text else self.help


def option(flag: str, help: str = "", *, default=None, default_text=None, needs=None, **argparse_kwargs) -> KindOption:
    return KindOption(flag, help, default, default_text, needs, argparse_kwargs)


def _value_text(value) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, float):
        return re.sub(r"e([+-])0*(\d)", r"e\1\2", f"{value:g}")  # 5e-05 -> 5e-5
    return str(value)


@dataclass(frozen=True)
class BiasKind:
    """A ``--kind``: its name, its ``--kind`` help, its options and its fitter (see the module's docstring)."""
    name: str
    help: str
    options: Tuple[KindOption, ...]
    fit: Callable


Fit = Callable[[List[int]], Callable[[List[int]], object]]


def fit_overlap(args, train) -> Tuple[Fit, Dict, Dict]:
    from ..bias import OverlapBias

    if train.text_pair is None:
        raise CliError("--kind overlap needs text pairs (premise and hypothesis: --task nli or --text-pair-column)")
    last: Dict = {}

    def fit_rows(rows):
        model = OverlapBias(C=args.C).fit(train.subset(rows))
        last["model"] = model.meta()
        return lambda held: model.log_probs(train.subset(held))

    return fit_rows, {"C": args.C}, last


def fit_column(args, train) -> Tuple[Fit, Dict, Dict]:
    from ..bias import ColumnBias

    if args.folds != 1:
        raise CliError(f"--folds {args.folds}: --kind column scores a classifier trained elsewhere (--model), so "
                       f"nothing is fitted here to cross-fit; expected --folds 1 (or --kind weak-learner --folds K)")
    try:
        model = ColumnBias(args.model, column=args.column, label_names=list(train.label_names))
    except ValueError as error:
        raise CliError(f"--kind column: {error}") from error
    device = get_device(args.device)
    options = {"model": args.model, "column": args.column}
    return (lambda rows: lambda held: model.log_probs(train.subset(held), batch_size=args.batch_size,
                                                      device=device)), options, {"model": options}


def fit_features(args, train) -> Tuple[Fit, Dict, Dict]:
    from ..bias import FeatureBias, read_feature_columns, typed_columns

    columns = typed_columns(train, read_feature_columns(train, args.feature_columns), args.categorical_columns or ())
    numeric = [c.name for c in columns if c.kind == "numeric"]
    if args.model_type == "exact" and numeric:
        raise CliError(f"--model-type exact: feature column(s) {', '.join(numeric)} hold numbers; expected "
                       f"categorical columns (--categorical-columns {','.join(numeric)}, or --model-type logistic)")
    model_type = args.model_type or ("logistic" if numeric else "exact")
    class_weight = None if args.class_weight == "none" else args.class_weight
    options = {"feature_columns": [c.name for c in columns], "kinds": {c.name: c.kind for c in columns},
               "model_type": model_type}
    options.update({"smoothing": args.smoothing} if model_type == "exact"
                   else {"C": args.C, "class_weight": class_weight})
    last: Dict = {}

    def fit_rows(rows):
        model = FeatureBias(model_type, smoothing=args.smoothing, C=args.C, class_weight=class_weight)
        model.fit(columns, train.labels, train.num_labels, rows)
        last["model"] = model.meta()
        return lambda held: model.log_probs(columns, held)

    return fit_rows, options, last


def fit_weak_learner(args, train) -> Tuple[Fit, Dict, Dict]:
    from ..bias import WeakLearner

    options = {"model": args.model, "subset": args.subset, "epochs": args.epochs, "layers": args.layers,
               "lr": args.lr, "batch_size": args.batch_size, "max_length": args.max_length, "seed": args.seed,
               "loss": args.weak_loss}
    if options["loss"] == "gce":
        options["gce_q"] = args.gce_q
    elif "gce_q" in args.kind_options_given:
        raise CliError(f"--gce-q {args.gce_q}: it is the q of --weak-loss gce, not ce; expected --weak-loss gce "
                       f"(the default) with it")
    device = get_device(args.device)
    last: Dict = {}

    def fit_rows(rows):
        model = WeakLearner(**options, device=device).fit(train, rows)
        last["model"] = dict(model.meta(), subset_rows=model.n_subset)
        return lambda held: model.log_probs(train, held)

    return fit_rows, options, last


# options two kinds take: one flag, listed by both
_C = option("--C", "inverse L2 strength of the logistic regression (features: --model-type logistic; Clark's C; a "
            "finite number > 0)", default=100.0, type=positive_float)
_BATCH_SIZE = option("--batch-size", "examples per batch", default=32, type=positive_int)
_MODEL = option("--model", metavar="DIR")

BIAS_KINDS: Tuple[BiasKind, ...] = (
    BiasKind("overlap", "word-overlap features + logistic regression (NLI)", (_C,), fit_overlap),
    BiasKind("column", "a classifier trained on one column (--model)", (
        _MODEL.but(help="the classifier trained on that column",
                   needs="a classifier trained on that column (cat-fast train --text-column ...)"),
        option("--column", "the column it reads (text, text_pair or a column name)", default="text_pair"),
        _BATCH_SIZE), fit_column),
    BiasKind("features", "the label given columns of the file (--feature-columns)", (
        option("--feature-columns", "columns of the training file (categorical, or numbers)",
               needs="columns of the training file whose values carry the bias", type=column_names,
               metavar="A,B,..."),
        option("--categorical-columns", "feature columns of numbers to treat as categories", type=column_names,
               metavar="A,B,..."),
        option("--model-type", "exact: the smoothed conditional p(y | values) (categorical columns); logistic: "
               "one-hot categories + numbers, standardised", default_text="exact when every column is categorical",
               choices=("exact", "logistic")),
        option("--smoothing", "exact: additive smoothing of the counts", default=1.0, type=positive_float,
               metavar="ALPHA"),
        option("--class-weight", "logistic: class weights (overlap uses balanced)", default="none",
               choices=("none", "balanced")),
        _C), fit_features),
    BiasKind("weak-learner", "a small classifier fine-tuned on a small subset (an unknown bias)", (
        _MODEL.but(help="the classifier to fine-tune", default="minilm"),
        option("--subset", "examples drawn from the fitting rows (all when fewer)", default=2000, type=at_least_two,
               metavar="N"),
        option("--epochs", "training epochs", default=3, type=positive_int),
        option("--layers", "keep only the first K encoder layers", default_text="all", type=positive_int,
               metavar="K"),
        option("--lr", "AdamW learning rate", default=5e-5, type=positive_float),
        option("--max-length", "tokens per example", default=128, type=at_least_two),
        option("--weak-loss", "its training loss. gce: generalized cross-entropy (1 - p_y^q)/q, whose gradient "
               "weighs each row by p_y^q, so the rows the learner already fits (those of the feature it learns "
               "first, often a shortcut) outweigh the rows against it and it stays with that feature; ce: "
               "cross-entropy, which can go on from that feature to the task itself within the default epochs (a "
               "bias model that knows the task leaves the bias-model methods nothing to learn)", default="gce",
               choices=("ce", "gce")),
        option("--gce-q", "--weak-loss gce: q in (0, 1] (towards 0: cross-entropy; 1: mean absolute error)",
               default=0.7, type=gce_q, metavar="Q"),
        _BATCH_SIZE), fit_weak_learner),
)
KINDS = tuple(kind.name for kind in BIAS_KINDS)
_BY_NAME = {kind.name: kind for kind in BIAS_KINDS}


def kind_options() -> Dict[str, Dict[str, KindOption]]:
    """flag -> {the name of each kind that takes it: its declaration there}, in declaration order."""
    table: Dict[str, Dict[str, KindOption]] = {}
    for kind in BIAS_KINDS:
        for opt in kind.options:
            table.setdefault(opt.flag, {})[kind.name] = opt
    for flag, by_kind in table.items():
        if len({repr(sorted(o.argparse.items())) for o in by_kind.values()}) > 1:
            raise TypeError(f"{flag}: the kinds {', '.join(by_kind)} declare it with other argparse keywords")
    return table


def kind_help() -> str:
    return "; ".join(f"{kind.name}: {kind.help}" for kind in BIAS_KINDS)


def _kinds_text(names) -> str:
    return "--kind " + " and ".join(names)


def add_kind_options(parser: argparse.ArgumentParser) -> None:
    """One argument group per set of kinds (titled by them), each option added once; an option is absent from the
    namespace unless given (`resolve_kind_options` refuses it for other kinds and fills in the defaults)."""
    groups: Dict[str, Any] = {}
    for flag, by_kind in kind_options().items():
        title = _kinds_text(by_kind)
        if title not in groups:
            groups[title] = parser.add_argument_group(title, argument_default=argparse.SUPPRESS)
        texts = {name: o.shown() for name, o in by_kind.items()}
        text = next(iter(texts.values())) if len(set(texts.values())) == 1 else \
            "; ".join(f"{name}: {t}" for name, t in texts.items())
        groups[title].add_argument(flag, help=text.replace("%", "%%"), **next(iter(by_kind.values())).argparse)


def resolve_kind_options(args) -> BiasKind:
    """``args.kind``'s declaration, after refusing an option of another kind (one line naming the option and the
    kinds that take it) and a needed option not given; each option of this kind not given takes its default, and
    every other kind's option is None. ``args.kind_options_given``: the dests given."""
    kind = _BY_NAME[args.kind]
    table = kind_options()
    given = frozenset(o.dest for by_kind in table.values() for o in by_kind.values() if hasattr(args, o.dest))
    for flag, by_kind in table.items():
        if next(iter(by_kind.values())).dest in given and kind.name not in by_kind:
            raise CliError(f"{flag} is for {_kinds_text(by_kind)}, not {kind.name}")
    for flag, by_kind in table.items():
        mine = by_kind.get(kind.name)
        dest = next(iter(by_kind.values())).dest
        if mine is None:
            setattr(args, dest, None)
        elif mine.needs and not getattr(args, dest, None):
            metavar = mine.argparse.get("metavar", dest.upper())
            raise CliError(f"{_kinds_text([kind.name])} needs {flag} {metavar}: {mine.needs}")
        elif dest not in given:
            setattr(args, dest, mine.default)
    args.kind_options_given = given
    return kind
