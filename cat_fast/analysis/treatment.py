"""The treatment set of a mediation analysis (docs/METHODS.md §3): the examples that carry the bias, whose mean
first-token activations z̄ are patched into the others. Any task, single texts or pairs.

    from cat_fast.analysis import treatment
    treat, control = treatment.select_treatment(data, overlap_quantile=0.95)         # NLI: high word overlap
    treat, control = treatment.select_treatment(data, ids=["3", "17", ...])          # a list of example ids
    treat, control = treatment.select_treatment(data, where=(values, "negated"))     # a column's value
    treat, control = treatment.select_treatment(data, bias=log_probs, confidence=0.8)  # a confident bias model
    z_rows = treatment.class_balanced(data.labels, treat, None, generator)          # as many of each class

`data` is a `cat_fast.data.CadData`; exactly one rule is given. ``treat`` and ``control`` are sorted row indices
(LongTensors) that split the rows: control = every row not in the treatment. Each rule raises ``ValueError`` naming
what is wrong (an id not in the data, a table of the wrong length, no rows selected, one class only).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

__all__ = ["select_treatment", "class_balanced", "RULES"]

RULES = ("ids", "where", "bias", "overlap_quantile")


def select_treatment(data, *, ids: Optional[Sequence[str]] = None, where: Optional[Tuple[Sequence, str]] = None,
                     bias: Optional[torch.Tensor] = None, confidence: float = 0.8,
                     overlap_quantile: Optional[float] = None, min_classes: int = 2
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(treatment, control)`` row indices of `data` by one rule:

    * ``ids``: the examples with these ids (``data.ids``); an id not in the data is an error;
    * ``where=(values, value)``: the rows whose ``values[i]`` (one per row, e.g. a column of the file) equals
      ``value``, compared as text;
    * ``bias``: log-probabilities ``[N, C]`` of a bias model, rows in `data`'s order: the rows whose bias
      probability of its own predicted class is at least ``confidence``;
    * ``overlap_quantile``: text pairs whose share of hypothesis words found in the premise is at or above this
      quantile (the paper's NLI rule).

    The treatment must hold at least ``min_classes`` classes (it is class-balanced before use: `class_balanced`).
    """
    given = [name for name, v in (("ids", ids), ("where", where), ("bias", bias),
                                  ("overlap_quantile", overlap_quantile)) if v is not None]
    if len(given) != 1:
        raise ValueError(f"select_treatment: expected exactly one rule of {', '.join(RULES)}, got "
                         f"{', '.join(given) or 'none'}")
    n = len(data.labels)
    if ids is not None:
        chosen, what = _by_ids(data, ids), "the ids given"
    elif where is not None:
        chosen, what = _by_value(where, n), f"the rows whose value is {where[1]!r}"
    elif bias is not None:
        chosen, what = _by_bias(bias, n, confidence), f"the rows the bias model predicts with p >= {confidence:g}"
    else:
        chosen, what = _by_overlap(data, overlap_quantile), f"the pairs at or above overlap quantile {overlap_quantile:g}"
    treat = torch.nonzero(chosen).flatten()
    if treat.numel() == 0:
        raise ValueError(f"the treatment set ({what}) has no rows of the {n}; expected at least one example of "
                         f"{min_classes} classes")
    labels = torch.as_tensor(data.labels)
    classes = sorted(set(labels[treat].tolist()))
    if len(classes) < min_classes:
        names = ", ".join(str(data.label_names[c]) for c in classes)
        raise ValueError(f"the treatment set ({what}, {treat.numel()} rows) holds class {names} only; expected "
                         f"examples of at least {min_classes} classes (it is class-balanced)")
    if treat.numel() == n:
        raise ValueError(f"the treatment set ({what}) holds every one of the {n} rows; expected some rows left as "
                         f"the control set")
    return treat, torch.nonzero(~chosen).flatten()


def class_balanced(labels: Sequence[int], rows: torch.Tensor, per_class: Optional[int], generator) -> torch.Tensor:
    """As many rows of each class of `rows` (the fewest any class has, or `per_class` if smaller), drawn with
    `generator`, classes in order."""
    labels = torch.as_tensor(labels)
    rows = torch.as_tensor(rows, dtype=torch.long)
    classes = sorted(set(labels[rows].tolist()))
    if not classes:
        return torch.empty(0, dtype=torch.long)
    n = min(int((labels[rows] == c).sum()) for c in classes)
    n = n if per_class is None else min(n, per_class)
    picks = []
    for c in classes:
        idx = rows[labels[rows] == c]
        picks.append(idx[torch.randperm(idx.numel(), generator=generator)[:n]])
    return torch.cat(picks)


def _by_ids(data, ids) -> torch.Tensor:
    ids = [str(i) for i in ids]
    row = {str(i): r for r, i in enumerate(data.ids)}
    missing = [i for i in ids if i not in row]
    if missing:
        raise ValueError(f"treatment id {missing[0]!r} is not an example id of the samples ({len(missing)} of "
                         f"{len(ids)} missing); expected ids of the samples' rows")
    chosen = torch.zeros(len(data.labels), dtype=torch.bool)
    chosen[[row[i] for i in ids]] = True
    return chosen


def _by_value(where, n: int) -> torch.Tensor:
    values, value = where
    values = list(values)
    if len(values) != n:
        raise ValueError(f"where: {len(values)} values for {n} rows; expected one value per row")
    return torch.tensor([v is not None and str(v) == str(value) for v in values], dtype=torch.bool)


def _by_bias(bias, n: int, confidence: float) -> torch.Tensor:
    bias = torch.as_tensor(bias)
    if bias.dim() != 2 or bias.shape[0] != n:
        raise ValueError(f"bias: log-probabilities of shape {tuple(bias.shape)}; expected [{n}, C], one row per "
                         f"example")
    if not 0 < confidence <= 1:
        raise ValueError(f"confidence: expected a probability in (0, 1], got {confidence}")
    return bias.float().exp().max(-1).values >= confidence


def _by_overlap(data, quantile: float) -> torch.Tensor:
    from ..bias.features import FEATURE_NAMES, overlap_features

    if data.text_pair is None:
        raise ValueError("overlap_quantile: the word-overlap rule needs text pairs (premise, hypothesis); these "
                         "are single texts")
    if not 0 < quantile < 1:
        raise ValueError(f"overlap_quantile: expected a number in (0, 1), got {quantile}")
    overlap = overlap_features(data.text, data.text_pair)[:, FEATURE_NAMES.index("h_fraction_in_p")]
    return overlap >= torch.quantile(overlap, quantile)
