"""``cat-fast bias fit``: a bias model's predictions for the training examples, for the bias-model methods
(``cat-fast train --method poe|reweight|reweight-inverse|learned-mixin|conf-reg --bias DIR``).

Kinds (`cat_fast.cli.bias_kinds.BIAS_KINDS`: each kind's options, their defaults and its fitter, declared once):

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
from typing import Dict

from .bias_kinds import BIAS_KINDS, resolve_kind_options
from .common import AtomicDir, CliError, write_json
from .sources import Source

__all__ = ["fit", "BIAS_FILE", "resolve", "FITTERS"]

BIAS_FILE = "bias.jsonl"


def resolve(path: str) -> str:
    """A bias file, or the directory `cat-fast bias fit` wrote."""
    return os.path.join(path, BIAS_FILE) if os.path.isdir(path) else path


FITTERS = {kind.name: kind.fit for kind in BIAS_KINDS}


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

    kind = resolve_kind_options(args)
    _check_calibrate(args)
    source = Source.from_args(args)
    AtomicDir.check(args.out, args.overwrite, inputs=list(args.train or []) + [args.model or ""])
    train = source.read_train(args.train)
    labels = tuple(train.label_names)
    require_classes(train)
    try:
        fit_rows, options, last = kind.fit(args, train)
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
