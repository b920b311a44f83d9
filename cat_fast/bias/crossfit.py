"""Cross-fitted bias predictions: each training example's bias log-probabilities come from a model that did not
see it (docs/METHODS.md §4: in-sample predictions of a model that can memorise its rows are over-confident, not a
bias estimate).

Typical use::

    def fit(rows):                                  # fit on these rows of train, return a predictor of others
        model = OverlapBias().fit(train.subset(rows))
        return lambda held_out: model.log_probs(train.subset(held_out))

    cf = cross_fit(train, fit, folds=5, seed=0)    # cf.log_probs [N, C], cf.fold [N], cf.fold_accuracy [5]

The rows are split into ``folds`` folds by counterfactual group (``CadData.groups``: an original and its edits stay
in one fold, so a row's partner never informs its prediction): the groups, shuffled with ``random.Random(seed)``,
go largest first to the fold holding the fewest rows. Fold ``k``'s rows are predicted by a model fitted on the
other folds. ``folds=1`` is in-sample: one model fitted on every row predicts every row.

:func:`fit_temperature` calibrates held-out predictions: a fine-tuned network is over-confident (a weak learner
93 % right on held-out rows puts p ≈ 1 on nearly all of them), and a bias-model loss given p_bias(y) ≈ 1 leaves
the main model almost no gradient. One inverse temperature β, chosen on the cross-fitted predictions (rows the model
did not see), rescales them to their held-out accuracy.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

__all__ = ["CrossFitError", "CrossFit", "assign_folds", "cross_fit", "Calibration", "fit_temperature"]

Predictor = Callable[[List[int]], torch.Tensor]


class CrossFitError(ValueError):
    """A fold count the data cannot give (``reason`` without the ``folds=`` prefix, for a command line's wording)."""

    def __init__(self, folds, reason: str):
        self.folds, self.reason = folds, reason
        super().__init__(f"cross_fit: folds={folds!r}: {reason}")


@dataclass
class CrossFit:
    """``log_probs`` ``[N, C]`` float64 (row i from the model that did not see fold ``fold[i]``; in-sample when
    ``folds == 1``), ``fold_sizes`` and ``fold_accuracy`` (the held-out accuracy of each fold's predictions)."""

    log_probs: torch.Tensor
    fold: List[int]
    folds: int
    fold_sizes: List[int] = field(default_factory=list)
    fold_accuracy: List[float] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return sum(a * n for a, n in zip(self.fold_accuracy, self.fold_sizes)) / max(sum(self.fold_sizes), 1)


def _units(data) -> List[List[int]]:
    groups = getattr(data, "groups", None)
    return [list(g) for g in groups] if groups else [[i] for i in range(len(data))]


def assign_folds(data, folds: int, seed: int = 0) -> List[int]:
    """The fold (``0..folds − 1``) of each example of ``data``; the members of a group share one."""
    if isinstance(folds, bool) or not isinstance(folds, int) or folds < 1:
        raise CrossFitError(folds, "expected an integer >= 1 (1: in-sample predictions)")
    units = _units(data)
    grouped = any(len(u) > 1 for u in units)
    if folds > len(units):
        what = f"{len(units)} counterfactual groups (a group stays in one fold)" if grouped else f"{len(units)} rows"
        raise CrossFitError(folds, f"the training data has {what}; expected at most {len(units)} folds")
    order = list(range(len(units)))
    random.Random(seed).shuffle(order)
    order.sort(key=lambda u: -len(units[u]))  # stable: equal sizes stay shuffled
    size, fold = [0] * folds, [0] * len(data)
    for u in order:
        k = min(range(folds), key=lambda j: (size[j], j))
        size[k] += len(units[u])
        for i in units[u]:
            fold[i] = k
    return fold


def cross_fit(data, fit: Callable[[List[int]], Predictor], folds: int = 1, seed: int = 0,
              labels: Optional[Sequence[int]] = None) -> CrossFit:
    """Predictions for every example of ``data``: ``fit(rows)`` fits a model on those example indices and returns
    ``predict(rows) -> [len(rows), C]`` log-probabilities. ``labels``: class index per example (default
    ``data.labels``), for the accuracies; every fold's fitting rows must hold two classes or more."""
    labels = list(data.labels if labels is None else labels)
    fold = assign_folds(data, folds, seed)
    n = len(labels)
    if folds == 1:
        rows = list(range(n))
        lp = fit(rows)(rows).to(torch.float64)
        acc = float((lp.argmax(-1) == torch.tensor(labels)).double().mean()) if n else 0.0
        return CrossFit(lp, fold, 1, [n], [acc])
    out, sizes, accs = None, [], []
    for k in range(folds):
        held = [i for i in range(n) if fold[i] == k]
        rest = [i for i in range(n) if fold[i] != k]
        present = sorted({labels[i] for i in rest})
        if len(present) < 2:
            raise CrossFitError(folds, f"the rows outside fold {k} have one class (class {present[0]}); a bias model "
                                       f"needs two: expected fewer folds")
        lp = fit(rest)(held).to(torch.float64)
        if out is None:
            out = torch.zeros(n, lp.shape[1], dtype=torch.float64)
        out[held] = lp
        sizes.append(len(held))
        accs.append(float((lp.argmax(-1) == torch.tensor([labels[i] for i in held])).double().mean()))
    return CrossFit(out, fold, folds, sizes, accs)


@dataclass
class Calibration:
    """``log_softmax(β · log_probs)``: ``beta`` (1 / temperature) minimises the mean negative log-likelihood of the
    labels; ``nll_before`` / ``nll_after`` and ``confidence_before`` / ``_after`` (the mean probability of the
    predicted class) are reported with it."""

    beta: float
    nll_before: float
    nll_after: float
    confidence_before: float
    confidence_after: float

    def apply(self, log_probs: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(log_probs.to(torch.float64) * self.beta, dim=-1)

    def meta(self) -> dict:
        return {"method": "temperature", "temperature": 1.0 / self.beta, "nll_before": self.nll_before,
                "nll_after": self.nll_after, "confidence_before": self.confidence_before,
                "confidence_after": self.confidence_after}


def _nll(log_probs: torch.Tensor, labels: torch.Tensor, beta: float) -> float:
    scaled = torch.log_softmax(log_probs * beta, dim=-1)
    return float(-scaled.gather(1, labels[:, None]).mean())


def fit_temperature(log_probs: torch.Tensor, labels: Sequence[int], low: float = 1e-3, high: float = 20.0,
                    iterations: int = 80) -> Calibration:
    """The inverse temperature β in [``low``, ``high``] minimising the labels' mean negative log-likelihood under
    ``log_softmax(β · log_probs)`` (convex in β: golden-section search). Fit it on held-out predictions
    (:func:`cross_fit` with ``folds > 1``): in-sample ones would calibrate to the rows the model memorised."""
    lp = torch.as_tensor(log_probs, dtype=torch.float64)
    y = torch.as_tensor(list(labels), dtype=torch.long)
    if lp.ndim != 2 or lp.shape[0] != y.shape[0] or lp.shape[0] == 0:
        raise ValueError(f"fit_temperature: expected log_probs [N, C] with N = len(labels) > 0, got "
                         f"{tuple(lp.shape)} and {y.shape[0]} labels")
    if not torch.isfinite(lp).all():
        raise ValueError("fit_temperature: log_probs holds NaN or an infinity")
    ratio = (5 ** 0.5 - 1) / 2
    a, b = low, high
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = _nll(lp, y, c), _nll(lp, y, d)
    for _ in range(iterations):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = _nll(lp, y, c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = _nll(lp, y, d)
    beta, before = (a + b) / 2, _nll(lp, y, 1.0)
    after = _nll(lp, y, beta)
    if before <= after:  # never worse than leaving the predictions alone
        beta, after = 1.0, before

    def confidence(scale):
        return float(torch.softmax(lp * scale, dim=-1).max(-1).values.mean())

    return Calibration(beta, before, after, confidence(1.0), confidence(beta))
