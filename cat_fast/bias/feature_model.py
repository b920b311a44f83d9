"""A bias model of named features: the label's dependence on categorical and numeric columns of the data (a
genre, a source, a length, a planted cue; docs/METHODS.md §4), as log-probabilities ``b`` for the bias-model
losses.

Typical use::

    cols = typed_columns(train, read_feature_columns(train, ["genre", "cue"]))
    fb = FeatureBias("exact", smoothing=1.0).fit(cols, train.labels, train.num_labels)      # rows=None: all
    b = fb.log_probs(cols)                                                                  # [N, C] float64

Model types:

* ``"exact"`` (categorical columns only): the empirical conditional with additive smoothing ``α``:
  ``p(y | v) = (n(v, y) + α) / (n(v) + C·α)`` for the combination ``v`` of the row's values; a combination the
  fitting rows never showed gets the smoothed class prior ``(n(y) + α) / (N + C·α)``.
* ``"logistic"``: one-hot categoricals (a category the fitting rows never showed: all zeros) and the numeric
  columns, every column standardised with the fitting rows' mean and standard deviation, in an L2-penalised
  multinomial logistic regression (``C``, ``class_weight``). With scikit-learn installed (``solver="auto"``) its
  ``LogisticRegression`` (lbfgs) solves it, else the built-in Newton solver (:class:`LogisticRegression`); both
  minimise ``Σ s_i·CE_i + ‖W‖²/(2C)`` (scikit-learn's binary model has one weight vector: it gets ``2C``, the same
  minimiser).
* ``"auto"``: exact when every column is categorical, else logistic.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence

import torch

from .feature_columns import FeatureColumn
from .logistic import LogisticRegression

__all__ = ["FeatureBias", "MODEL_TYPES", "has_sklearn"]

MODEL_TYPES = ("auto", "exact", "logistic")
_SOLVERS = ("auto", "sklearn", "builtin")


def has_sklearn() -> bool:
    try:
        import sklearn.linear_model  # noqa: F401
    except ImportError:
        return False
    return True


class FeatureBias:
    """p(y | feature values): ``model_type`` (:data:`MODEL_TYPES`), ``smoothing`` (exact: ``α`` > 0), ``C`` and
    ``class_weight`` (``None`` or ``"balanced"``) and ``solver`` (``"auto"``, ``"sklearn"``, ``"builtin"``) for
    logistic. After :meth:`fit`: ``model_type_`` (what ``"auto"`` chose) and ``solver_``."""

    def __init__(self, model_type: str = "auto", smoothing: float = 1.0, C: float = 100.0,
                 class_weight: Optional[str] = None, solver: str = "auto"):
        if model_type not in MODEL_TYPES:
            raise ValueError(f"FeatureBias: model_type={model_type!r}; expected one of {', '.join(MODEL_TYPES)}")
        if not (isinstance(smoothing, (int, float)) and math.isfinite(smoothing) and smoothing > 0):
            raise ValueError(f"FeatureBias: smoothing={smoothing!r}; expected a finite number > 0 (additive "
                             f"smoothing keeps every log-probability finite)")
        if solver not in _SOLVERS:
            raise ValueError(f"FeatureBias: solver={solver!r}; expected one of {', '.join(_SOLVERS)}")
        if solver == "sklearn" and not has_sklearn():
            raise ValueError("FeatureBias: solver='sklearn' but scikit-learn is not installed (pip install "
                             "'cat_fast[bias]')")
        LogisticRegression(C=C, class_weight=class_weight)  # checks C and class_weight
        self.model_type, self.smoothing, self.C = model_type, float(smoothing), float(C)
        self.class_weight, self.solver = class_weight, solver
        self.model_type_: Optional[str] = None

    # -- fitting
    def fit(self, columns: Sequence[FeatureColumn], labels: Sequence[int], num_classes: int,
            rows: Optional[Sequence[int]] = None) -> "FeatureBias":
        """Fit on ``rows`` (default: all) of ``columns`` (:func:`~cat_fast.bias.typed_columns`), ``labels`` the
        class index of every example (``0..num_classes − 1``)."""
        columns = list(columns)
        if not columns:
            raise ValueError("FeatureBias.fit: no feature columns; expected at least one")
        rows = list(range(len(labels))) if rows is None else list(rows)
        if not rows:
            raise ValueError("FeatureBias.fit: no rows to fit on")
        numeric = [c.name for c in columns if c.kind == "numeric"]
        kind = self.model_type if self.model_type != "auto" else ("logistic" if numeric else "exact")
        if kind == "exact" and numeric:
            raise ValueError(f"FeatureBias: model_type='exact' needs categorical columns; {', '.join(numeric)} "
                             f"numeric (use the logistic model, or treat it as categorical)")
        self.columns = [c.name for c in columns]
        self.num_classes = int(num_classes)
        y = torch.tensor([labels[r] for r in rows], dtype=torch.long)
        self.model_type_ = kind
        if kind == "exact":
            self._fit_exact(columns, rows, y)
        else:
            self._fit_logistic(columns, rows, y)
        self.n_train = len(rows)
        return self

    def _fit_exact(self, columns, rows, y):
        K, a = self.num_classes, self.smoothing
        counts: Dict[tuple, torch.Tensor] = {}
        for r, label in zip(rows, y.tolist()):
            counts.setdefault(tuple(c.values[r] for c in columns), torch.zeros(K, dtype=torch.float64))[label] += 1
        prior = torch.bincount(y, minlength=K).to(torch.float64)
        self._prior = torch.log(prior + a) - math.log(len(rows) + K * a)
        self._table = {v: torch.log(n + a) - torch.log(n.sum() + K * a) for v, n in counts.items()}
        self.solver_ = None

    def _encode(self, columns, rows) -> torch.Tensor:
        parts = []
        for c in columns:
            if c.kind == "numeric":
                parts.append(torch.tensor([[c.values[r]] for r in rows], dtype=torch.float64))
            else:
                index = self._categories[c.name]
                block = torch.zeros(len(rows), len(index), dtype=torch.float64)
                for i, r in enumerate(rows):
                    k = index.get(c.values[r])
                    if k is not None:
                        block[i, k] = 1.0
                parts.append(block)
        return torch.cat(parts, 1)

    def _fit_logistic(self, columns, rows, y):
        missing = sorted(set(range(self.num_classes)) - set(y.tolist()))
        if missing:
            raise ValueError(f"FeatureBias: class(es) {missing} have no example among the {len(rows)} fitting rows; "
                             f"the logistic model needs every class")
        self._categories = {c.name: {v: k for k, v in enumerate(sorted({c.values[r] for r in rows}))}
                            for c in columns if c.kind == "categorical"}
        X = self._encode(columns, rows)
        self.solver_ = "sklearn" if self.solver == "sklearn" or (self.solver == "auto" and has_sklearn()) \
            else "builtin"
        clf = LogisticRegression(C=self.C, class_weight=self.class_weight, max_iter=100, tol=1e-10)
        if self.solver_ == "builtin":
            self._clf = clf.fit(X, y, num_classes=self.num_classes)
            return
        from sklearn.linear_model import LogisticRegression as SkLogistic

        std = X.std(0, unbiased=False)
        self._mean, self._scale = X.mean(0), torch.where(std > 0, std, torch.ones_like(std))  # as the built-in
        C = 2 * self.C if self.num_classes == 2 else self.C
        sk = SkLogistic(C=C, class_weight=self.class_weight, tol=1e-12, max_iter=10000)
        self._clf = sk.fit(((X - self._mean) / self._scale).numpy(), y.numpy())

    # -- prediction
    def log_probs(self, columns: Sequence[FeatureColumn], rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        """``[n, num_classes]`` float64 log-probabilities of ``rows`` (default: all) of ``columns``."""
        if self.model_type_ is None:
            raise RuntimeError("FeatureBias: not fitted yet; call fit(columns, labels, num_classes) first")
        columns = list(columns)
        if [c.name for c in columns] != self.columns:
            raise ValueError(f"FeatureBias.log_probs: columns {[c.name for c in columns]}; fitted on {self.columns}")
        rows = list(range(len(columns[0].values))) if rows is None else list(rows)
        if self.model_type_ == "exact":
            out = [self._table.get(tuple(c.values[r] for c in columns), self._prior) for r in rows]
            return torch.stack(out) if out else torch.zeros(0, self.num_classes, dtype=torch.float64)
        X = self._encode(columns, rows)
        if self.solver_ == "builtin":
            return self._clf.log_proba(X)
        d = torch.from_numpy(self._clf.decision_function(((X - self._mean) / self._scale).numpy())).double()
        logits = torch.stack([torch.zeros_like(d), d], 1) if d.dim() == 1 else d
        return torch.log_softmax(logits, 1)

    def meta(self) -> Dict[str, Any]:
        """What made the predictions (for the bias file's meta)."""
        out: Dict[str, Any] = {"columns": list(self.columns), "model_type": self.model_type_}
        if self.model_type_ == "exact":
            out.update(smoothing=self.smoothing, combinations=len(self._table))
        else:
            out.update(C=self.C, class_weight=self.class_weight, solver=self.solver_,
                       categories={k: len(v) for k, v in self._categories.items()})
        return out
