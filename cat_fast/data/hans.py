"""A HANS-style NLI challenge set (McCoy et al., ACL 2019; MIT), shipped in ``cat_fast/data/hans/``, and its scoring.

Typical use::

    from cat_fast import data
    hans = data.load_hans()                             # 3,000 premise/hypothesis pairs; entailment / non-entailment
    hans.heuristic[0], hans.subcase[0]                  # "lexical_overlap", "ln_subject/object_swap"
    preds = model_predictions(hans)                     # a 3-way NLI model's label ids (or names, or logits [N, C])
    scores = data.score_hans(preds, hans, ("entailment", "neutral", "contradiction"))
    scores["hans"], scores["hans/lexical_overlap/non-entailment"], scores["hans/subcase/ln_passive"]

The shipped ``dev.tsv`` (columns ``sentence1``, ``sentence2``, ``gold_label``, ``heuristic``, ``subcase``) holds 100
examples of each of the 30 subcases (3 heuristics × 5 entailment and 5 non-entailment subcases), generated from the
HANS authors' templates; ``cat_fast/data/hans/README.md`` says how. It is a test set for NLI models (e.g. trained on
CAD NLI), never training data. :func:`score_hans` maps every predicted label other than ``entailment`` (neutral,
contradiction) to ``non-entailment`` before scoring, as HANS prescribes. Example ids are the 0-based row indices
(``"0"`` .. ``"2999"``), as :func:`~cat_fast.data.load_table` gives them.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from .core import CadData, DataError, TaskSpec
from .tables import load_table, read_rows

__all__ = ["HANS_PATH", "HANS_LABELS", "HANS_HEURISTICS", "HansData", "load_hans", "score_hans"]

HANS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hans", "dev.tsv")
HANS_LABELS = ("entailment", "non-entailment")
HANS_HEURISTICS = ("lexical_overlap", "subsequence", "constituent")
_ENTAILMENT = "entailment"


@dataclass
class HansData(CadData):
    """A :class:`~cat_fast.data.core.CadData` of HANS pairs that also keeps, per example, its ``heuristic``
    (``lexical_overlap`` / ``subsequence`` / ``constituent``) and ``subcase`` (e.g. ``ln_passive``: l/s/c = the
    heuristic, e/n = entailment / non-entailment); :meth:`subset` keeps them."""

    heuristic: List[str] = field(default_factory=list)
    subcase: List[str] = field(default_factory=list)

    def __post_init__(self):
        super().__post_init__()
        if len(self.heuristic) != len(self) or len(self.subcase) != len(self):
            raise DataError(f"HansData: {len(self)} examples but {len(self.heuristic)} heuristic(s) and "
                            f"{len(self.subcase)} subcase(s); expected one of each per example")

    def subset(self, indices: Sequence[int]) -> "HansData":
        indices = list(indices)
        return _hans(CadData.subset(self, indices), [self.heuristic[i] for i in indices],
                     [self.subcase[i] for i in indices])


def _hans(base: CadData, heuristic: List[str], subcase: List[str], spec: Optional[TaskSpec] = None) -> HansData:
    return HansData(task=spec or base.spec, text=base.text, text_pair=base.text_pair, labels=base.labels,
                    is_orig=base.is_orig, group=base.group, sources=base.sources, ids=base.ids, pairing=base.pairing,
                    skipped=base.skipped, skipped_where=base.skipped_where, heuristic=heuristic, subcase=subcase)


def load_hans(path: Optional[str] = None) -> HansData:
    """The HANS-style pairs of ``path`` (default: the shipped ``cat_fast/data/hans/dev.tsv``, 3,000 rows).

    Any file :func:`~cat_fast.data.load_table` reads, with columns ``sentence1`` (premise), ``sentence2``
    (hypothesis), ``gold_label`` (``entailment`` / ``non-entailment``), ``heuristic`` and ``subcase``. Text pairs;
    label ids in :data:`HANS_LABELS` order; ids = 0-based row indices. Raises
    :class:`~cat_fast.data.core.DataError` (file, line, cause) for a bad file or an empty heuristic / subcase.
    """
    path = HANS_PATH if path is None else os.fspath(path)
    base = load_table(path, text_column="sentence1", text_pair_column="sentence2", label_column="gold_label",
                      labels=HANS_LABELS)
    table = read_rows(path, ["heuristic", "subcase"], None)
    row_at = {str(w): r for r, w in enumerate(table.where)}
    heuristic, subcase = [], []
    for src in base.sources:  # "file:line" (a dataset: "name:row") of each kept example
        r = row_at[src.rsplit(":", 1)[1]]
        for col, out in (("heuristic", heuristic), ("subcase", subcase)):
            v = table.cols[col][r]
            v = v.strip() if isinstance(v, str) else ""
            if not v:
                raise DataError(f"{table.loc(r)}: empty {col!r}; expected a HANS {col} name (e.g. "
                                f"{'lexical_overlap' if col == 'heuristic' else 'ln_passive'})")
            out.append(v)
    spec = TaskSpec("hans", base.spec.label_column, base.spec.text_columns, base.spec.labels)
    return _hans(base, heuristic, subcase, spec)


def _predicted_names(predicted_labels: Any, label_names: Sequence[str], n: int) -> List[str]:
    """Predicted label names from label ids, names, or scores [N, C] (argmax)."""
    x = predicted_labels
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu()
        if x.dim() == 2:
            if x.shape[1] != len(label_names):
                raise ValueError(f"score_hans: predicted_labels are scores of shape {tuple(x.shape)}, but label_names "
                                 f"has {len(label_names)} names; expected [N, {len(label_names)}]")
            x = x.argmax(-1)
        elif x.dim() != 1:
            raise ValueError(f"score_hans: predicted_labels has shape {tuple(x.shape)}; expected label ids [N] or "
                             f"scores [N, C]")
        if x.is_floating_point() or x.is_complex():
            raise ValueError(f"score_hans: predicted_labels is a 1-D {x.dtype} tensor; expected integer label ids")
    if hasattr(x, "tolist"):  # torch / numpy
        x = x.tolist()
    x = list(x)
    if len(x) != n:
        raise ValueError(f"score_hans: {len(x)} predictions for {n} examples; expected one per example")
    out = []
    for i, v in enumerate(x):
        if isinstance(v, str):
            if v not in label_names:
                raise ValueError(f"score_hans: prediction {i} is {v!r}, not one of label_names "
                                 f"({', '.join(label_names)})")
            out.append(v)
        elif isinstance(v, int) and not isinstance(v, bool) and 0 <= v < len(label_names):
            out.append(label_names[v])
        else:
            raise ValueError(f"score_hans: prediction {i} is {v!r}; expected a label id in 0..{len(label_names) - 1} "
                             f"or a name in label_names ({', '.join(label_names)})")
    return out


def _cell(hits: List[bool]) -> Dict[str, Any]:
    n = len(hits)
    return {"accuracy": sum(hits) / n if n else math.nan, "n": n}


def score_hans(predicted_labels: Any, data: CadData, label_names: Sequence[str], prefix: str = "hans"
               ) -> Dict[str, Dict[str, Any]]:
    """Accuracy of an NLI model on HANS pairs, overall and by heuristic, gold label and subcase.

    ``predicted_labels``: one prediction per example of ``data`` (a :class:`HansData` from :func:`load_hans`): label
    ids into ``label_names``, label names, or a score tensor ``[N, C]`` (its argmax). ``label_names``: the model's
    labels in id order (e.g. ``("entailment", "neutral", "contradiction")``); it must contain ``"entailment"``,
    and every other name counts as ``non-entailment``.

    Returns ``{key: {"accuracy": float, "n": int}}`` with keys ``hans`` (all), ``hans/<gold>``,
    ``hans/<heuristic>``, ``hans/<heuristic>/<gold>`` (e.g. ``hans/lexical_overlap/non-entailment``) and
    ``hans/subcase/<subcase>``, for the heuristics, gold labels and subcases present in ``data``.
    """
    label_names = tuple(label_names)
    if _ENTAILMENT not in label_names:
        raise ValueError(f"score_hans: label_names ({', '.join(map(str, label_names)) or 'none'}) has no "
                         f"{_ENTAILMENT!r}; HANS scores an NLI model, whose predictions are mapped to entailment / "
                         f"non-entailment")
    heuristic, subcase = getattr(data, "heuristic", None), getattr(data, "subcase", None)
    if heuristic is None or subcase is None:
        raise ValueError("score_hans: data has no heuristic / subcase per example; expected the HansData of "
                         "cat_fast.data.load_hans()")
    pred = [_ENTAILMENT if p == _ENTAILMENT else "non-entailment"
            for p in _predicted_names(predicted_labels, label_names, len(data))]
    gold = [_ENTAILMENT if data.label_names[y] == _ENTAILMENT else "non-entailment" for y in data.labels]
    hit = [p == g for p, g in zip(pred, gold)]
    heuristics = [h for h in HANS_HEURISTICS if h in heuristic] + sorted(set(heuristic) - set(HANS_HEURISTICS))
    golds = [g for g in HANS_LABELS if g in gold]
    out = {prefix: _cell(hit)}
    for g in golds:
        out[f"{prefix}/{g}"] = _cell([h for h, gi in zip(hit, gold) if gi == g])
    for h in heuristics:
        out[f"{prefix}/{h}"] = _cell([x for x, hi in zip(hit, heuristic) if hi == h])
        for g in golds:
            cell = [x for x, hi, gi in zip(hit, heuristic, gold) if hi == h and gi == g]
            if cell:
                out[f"{prefix}/{h}/{g}"] = _cell(cell)
    for s in sorted(set(subcase)):
        out[f"{prefix}/subcase/{s}"] = _cell([x for x, si in zip(hit, subcase) if si == s])
    return out
