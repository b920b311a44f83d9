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
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

__all__ = ["CrossFitError", "CrossFit", "assign_folds", "cross_fit"]

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
