"""``cat-fast bias fit``: a bias model's predictions for the training examples, for the bias-model methods
(``cat-fast train --method poe|reweight|reweight-inverse|learned-mixin|conf-reg --bias DIR``).

Kinds (`FITTERS`, one function each):

* ``overlap``: word-overlap features and a logistic regression (text pairs: NLI; `cat_fast.bias.OverlapBias`);
* ``column``: a classifier trained on one column (``--model DIR``, ``--column text_pair`` for a hypothesis-only
  bias; `cat_fast.bias.ColumnBias`); it is trained elsewhere, so it is not cross-fitted;
* ``features``: p(y | named columns of the training file) (``--feature-columns``, ``--model-type exact|logistic``,
  ``--smoothing``; `cat_fast.bias.FeatureBias`);
* ``weak-learner``: an unknown bias, a small classifier (``--model``, default minilm) fine-tuned on ``--subset``
  examples for ``--epochs``, optionally its first ``--layers``, with generalized cross-entropy (``--weak-loss gce``,
  the default, ``--gce-q``) or cross-entropy (``--weak-loss ce``) (`cat_fast.bias.WeakLearner`).

``--folds K`` cross-fits (`cat_fast.bias.cross_fit`): each row's prediction comes from a model fitted on the other
folds, counterfactual groups kept in one fold; 1 (the default) predicts in-sample. ``--calibrate temperature``
(the default for a cross-fitted weak learner) rescales the held-out predictions by one temperature fitted on them
(`cat_fast.bias.fit_temperature`). Writes ``DIR/bias.jsonl``
(per-example log-probabilities keyed by example id, with the fingerprint of each example's texts and label that
``train --bias`` checks, `cat_fast.bias.save_bias`) and ``DIR/bias_meta.json`` (kind, options, folds, each fold's
held-out accuracy, the model), atomically.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Dict, List, Tuple

from .common import AtomicDir, CliError, get_device, write_json
from .sources import Source

__all__ = ["fit", "BIAS_FILE", "resolve", "FITTERS"]

BIAS_FILE = "bias.jsonl"

# the options of one kind only (dest -> the kinds that take it); the parser leaves them out when not given
_KIND_OPTIONS = {"feature_columns": ("features",), "categorical_columns": ("features",), "model_type": ("features",),
                 "smoothing": ("features",), "class_weight": ("features",), "model": ("column", "weak-learner"),
                 "subset": ("weak-learner",), "epochs": ("weak-learner",), "layers": ("weak-learner",),
                 "lr": ("weak-learner",), "max_length": ("weak-learner",), "weak_loss": ("weak-learner",),
                 "gce_q": ("weak-learner",)}

Fit = Callable[[List[int]], Callable[[List[int]], object]]


def resolve(path: str) -> str:
    """A bias file, or the directory `cat-fast bias fit` wrote."""
    return os.path.join(path, BIAS_FILE) if os.path.isdir(path) else path


def _overlap(args, train) -> Tuple[Fit, Dict, Dict]:
    from ..bias import OverlapBias

    if train.text_pair is None:
        raise CliError("--kind overlap needs text pairs (premise and hypothesis: --task nli or --text-pair-column)")
    last: Dict = {}

    def fit_rows(rows):
        model = OverlapBias(C=args.C).fit(train.subset(rows))
        last["model"] = model.meta()
        return lambda held: model.log_probs(train.subset(held))

    return fit_rows, {"C": args.C}, last


def _column(args, train) -> Tuple[Fit, Dict, Dict]:
    from ..bias import ColumnBias

    if not args.model:
        raise CliError("--kind column needs --model DIR: a classifier trained on that column (cat-fast train "
                       "--text-column ...)")
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


def _features(args, train) -> Tuple[Fit, Dict, Dict]:
    from ..bias import FeatureBias, read_feature_columns, typed_columns

    if not args.feature_columns:
        raise CliError("--kind features needs --feature-columns A,B,...: columns of the training file whose values "
                       "carry the bias")
    columns = typed_columns(train, read_feature_columns(train, args.feature_columns), args.categorical_columns or ())
    numeric = [c.name for c in columns if c.kind == "numeric"]
    if args.model_type == "exact" and numeric:
        raise CliError(f"--model-type exact: feature column(s) {', '.join(numeric)} hold numbers; expected "
                       f"categorical columns (--categorical-columns {','.join(numeric)}, or --model-type logistic)")
    model_type = args.model_type or ("logistic" if numeric else "exact")
    smoothing = 1.0 if args.smoothing is None else args.smoothing
    class_weight = None if args.class_weight in (None, "none") else args.class_weight
    options = {"feature_columns": [c.name for c in columns], "kinds": {c.name: c.kind for c in columns},
               "model_type": model_type}
    options.update({"smoothing": smoothing} if model_type == "exact" else {"C": args.C, "class_weight": class_weight})
    last: Dict = {}

    def fit_rows(rows):
        model = FeatureBias(model_type, smoothing=smoothing, C=args.C, class_weight=class_weight)
        model.fit(columns, train.labels, train.num_labels, rows)
        last["model"] = model.meta()
        return lambda held: model.log_probs(columns, held)

    return fit_rows, options, last


def _weak_learner(args, train) -> Tuple[Fit, Dict, Dict]:
    from ..bias import WeakLearner

    options = {"model": args.model or "minilm", "subset": args.subset or 2000, "epochs": args.epochs or 3,
               "layers": args.layers, "lr": args.lr or 5e-5, "batch_size": args.batch_size,
               "max_length": args.max_length or 128, "seed": args.seed, "loss": args.weak_loss or "gce"}
    if options["loss"] == "gce":
        options["gce_q"] = 0.7 if args.gce_q is None else args.gce_q
    elif args.gce_q is not None:
        raise CliError(f"--gce-q {args.gce_q}: it is the q of --weak-loss gce, not ce; expected --weak-loss gce "
                       f"(the default) with it")
    device = get_device(args.device)
    last: Dict = {}

    def fit_rows(rows):
        model = WeakLearner(**options, device=device).fit(train, rows)
        last["model"] = dict(model.meta(), subset_rows=model.n_subset)
        return lambda held: model.log_probs(train, held)

    return fit_rows, options, last


FITTERS = {"overlap": _overlap, "column": _column, "features": _features, "weak-learner": _weak_learner}


def _check_kind_options(args) -> None:
    """Refuse an option of another kind; an option not given becomes None (the parser leaves it out)."""
    for dest, kinds in _KIND_OPTIONS.items():
        if getattr(args, dest, None) is not None and args.kind not in kinds:
            raise CliError(f"--{dest.replace('_', '-')} is for --kind {' and '.join(kinds)}, not {args.kind}")
        setattr(args, dest, getattr(args, dest, None))


def _cross_fit(args, train, fit_rows):
    from ..bias import CrossFitError, FeatureColumnError, WeakLearnerError, cross_fit
    from ..models.pretrained import ModelLoadError

    try:
        return cross_fit(train, fit_rows, folds=args.folds, seed=args.seed)
    except CrossFitError as error:
        raise CliError(f"--folds {args.folds}: {error.reason}") from error
    except WeakLearnerError as error:
        raise CliError(f"--{error.option.replace('_', '-')} {error.value}: {error.reason}") from error
    except (FeatureColumnError, ModelLoadError):
        raise
    except ValueError as error:
        raise CliError(f"--kind {args.kind}: {error}") from error


def _check_calibrate(args) -> None:
    if args.calibrate is None:
        args.calibrate = "temperature" if args.kind == "weak-learner" and args.folds > 1 else "none"
    if args.calibrate == "temperature" and args.folds == 1:
        raise CliError("--calibrate temperature needs held-out predictions (--folds K > 1): in-sample ones would be "
                       "calibrated to the rows the model memorised")


def _calibrate(args, crossfit, train):
    """The cross-fitted log-probabilities, rescaled by `fit_temperature` when ``--calibrate temperature``."""
    if args.calibrate != "temperature":
        return crossfit.log_probs, None
    from ..bias import fit_temperature

    try:
        calibration = fit_temperature(crossfit.log_probs, train.labels)
    except ValueError as error:
        raise CliError(f"--calibrate temperature: {error}") from error
    sys.stderr.write(f"cat-fast: calibrated the held-out predictions: temperature {1 / calibration.beta:.3g}, mean "
                     f"confidence {calibration.confidence_before:.3f} -> {calibration.confidence_after:.3f}\n")
    return calibration.apply(crossfit.log_probs), calibration


def fit(args) -> Dict:
    import torch

    from ..bias import FeatureColumnError, save_bias
    from ..data import require_classes

    _check_kind_options(args)
    _check_calibrate(args)
    source = Source.from_args(args)
    AtomicDir.check(args.out, args.overwrite, inputs=list(args.train or []) + [args.model or ""])
    train = source.read_train(args.train)
    labels = tuple(train.label_names)
    require_classes(train)
    try:
        fit_rows, options, last = FITTERS[args.kind](args, train)
        crossfit = _cross_fit(args, train, fit_rows)
    except FeatureColumnError as error:
        raise CliError(f"--feature-columns {','.join(args.feature_columns)}: {error}") from error
    log_probs, calibration = _calibrate(args, crossfit, train)
    accuracy = float((log_probs.argmax(-1) == torch.tensor(train.labels)).double().mean())
    meta = {"kind": args.kind, "options": options, "folds": args.folds, "seed": args.seed,
            "in_sample": args.folds == 1, "fold_sizes": crossfit.fold_sizes,
            "fold_accuracy": crossfit.fold_accuracy if args.folds > 1 else [], "model": last.get("model"),
            "task": source.name, "n": len(train), "train_accuracy": accuracy,
            "calibration": calibration.meta() if calibration else None}
    atomic = AtomicDir(args.out, args.overwrite)
    with atomic as tmp:
        save_bias(os.path.join(tmp, BIAS_FILE), train.ids, log_probs, labels, meta, data=train)
        write_json(os.path.join(tmp, "bias_meta.json"), meta)
        atomic.commit()
    how = "in-sample" if args.folds == 1 else f"held out, {args.folds} folds"
    sys.stderr.write(f"cat-fast: wrote {args.out} ({len(train)} examples; the bias model's accuracy {accuracy:.4f}, "
                     f"{how})\n")
    return meta
