"""The word-overlap bias model for NLI-like text pairs: :func:`overlap_features` + :class:`LogisticRegression`
(Clark et al. 2019's hand-crafted bias model, docs/METHODS.md §4).

Typical use::

    from cat_fast import bias, data
    train = data.load_builtin("nli")
    ob = bias.OverlapBias().fit(train)                       # 3 classes, on the training split only
    b = ob.log_probs(train)                                  # [N, 3] in train.label_names order
    bias.save_bias("bias_train.jsonl", train.ids, b, train.label_names, ob.meta())

``two_class=True`` is Clark's recipe: fit entailment vs non-entailment (neutral and contradiction merged), then
:func:`expand_two_class` to the main task's labels. The default fits the main labels directly.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from .features import FEATURE_NAMES, overlap_features
from .labels import expand_two_class
from .logistic import LogisticRegression

__all__ = ["OverlapBias"]

_ENTAILMENT = "entailment"


def _pairs(data, who: str) -> Tuple[list, list]:
    if getattr(data, "text_pair", None) is None:
        cols = getattr(getattr(data, "spec", None), "text_columns", ())
        raise ValueError(f"{who}: the data has no text pairs (one text column{': ' + cols[0] if cols else ''}); the "
                         f"overlap bias needs premise/hypothesis pairs (load them with text_pair_column=...)")
    return data.text, data.text_pair


class OverlapBias:
    """Word-overlap features (:data:`FEATURE_NAMES`) → class-balanced logistic regression (``C``, ``max_iter``,
    ``tol``: :class:`LogisticRegression`)."""

    def __init__(self, C: float = 100.0, two_class: bool = False, max_iter: int = 100, tol: float = 1e-10):
        self.clf = LogisticRegression(C=C, class_weight="balanced", max_iter=max_iter, tol=tol)
        self.two_class = bool(two_class)
        self.label_names: Optional[Tuple[str, ...]] = None
        self.n_train = 0

    def fit(self, train, label_names: Optional[Sequence[str]] = None) -> "OverlapBias":
        """Fit on ``train`` (a :class:`~cat_fast.data.CadData` of text pairs: its training split only).

        ``label_names``: the main task's labels in the order of :meth:`log_probs`' columns (default
        ``train.label_names``); it must name the same labels as ``train``. With ``two_class=True`` it must hold
        ``"entailment"``.
        """
        premises, hypotheses = _pairs(train, "OverlapBias.fit")
        names = tuple(train.label_names if label_names is None else label_names)
        if len(set(names)) != len(names) or set(names) != set(train.label_names):
            raise ValueError(f"OverlapBias.fit: label_names ({', '.join(map(str, names))}) are not the data's labels "
                             f"({', '.join(train.label_names)}) in some order")
        y = torch.tensor([names.index(train.label_names[k]) for k in train.labels], dtype=torch.long)
        if self.two_class:
            if _ENTAILMENT not in names:
                raise ValueError(f"OverlapBias.fit: two_class=True needs a label {_ENTAILMENT!r}; labels are "
                                 f"{', '.join(names)}")
            y = (y != names.index(_ENTAILMENT)).long()  # 0 = entailment, 1 = non-entailment
        X = overlap_features(premises, hypotheses)
        self.clf.fit(X, y, num_classes=2 if self.two_class else len(names))
        self.label_names, self.n_train = names, len(train)
        return self

    def log_probs(self, data) -> torch.Tensor:
        """Bias log-probabilities ``[N, C]`` (float32) of ``data``'s pairs, columns in ``self.label_names`` order."""
        if self.label_names is None:
            raise RuntimeError("OverlapBias: not fitted yet; call fit(train) first")
        premises, hypotheses = _pairs(data, "OverlapBias.log_probs")
        out = self.clf.log_proba(overlap_features(premises, hypotheses))
        if self.two_class:
            out = expand_two_class(out, self.label_names.index(_ENTAILMENT), len(self.label_names))
        return out.float()

    def meta(self) -> Dict[str, Any]:
        """What made the predictions, for :func:`~cat_fast.bias.save_bias`'s ``meta``."""
        return {"bias": "overlap", "features": list(FEATURE_NAMES), "C": self.clf.C, "two_class": self.two_class,
                "class_weight": "balanced", "n_train": self.n_train,
                "newton_iterations": getattr(self.clf, "n_iter_", None)}
