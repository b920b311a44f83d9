"""Training sets drawn from a :class:`~cat_fast.data.core.CadData`, each reproducible from its ``seed``: the
few-shot draw (:func:`few_shot`), the noisy-label scenario (:func:`with_label_noise`) and the long-tail scenario
(:func:`long_tail`). Each raises :class:`~cat_fast.data.core.DataError` naming the option it checks.
"""
from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Dict, List, Tuple

from .core import CadData, DataError

__all__ = ["few_shot", "with_label_noise", "long_tail", "metadata_from_cad"]


def few_shot(data: CadData, per_class: int, seed: int = 0, with_edits: bool = True) -> CadData:
    """``per_class`` ORIGINAL examples per class, drawn with ``random.Random(seed)``.

    With ``with_edits`` the edits of the sampled originals come along (their groups are kept whole).
    The result lists groups in data order. Raises :class:`DataError` when a class has fewer originals.
    """
    if per_class < 1:
        raise DataError(f"--per-class must be at least 1, got {per_class}")
    by_class: Dict[int, List[int]] = {c: [] for c in range(data.num_labels)}
    for i in range(len(data)):
        if data.is_orig[i]:
            by_class[data.labels[i]].append(i)
    rng = random.Random(seed)
    chosen = set()
    for c, ix in by_class.items():
        if per_class > len(ix):
            where = data.sources[ix[0]].rsplit(":", 1)[0] if ix and data.sources else "the training data"
            raise DataError(
                f"--per-class {per_class} is larger than class {data.label_names[c]!r}, which has only "
                f"{len(ix)} original example(s) in {where}"
            )
        chosen.update(rng.sample(ix, per_class))
    keep = []
    for ix in data.groups:
        origs = [i for i in ix if data.is_orig[i] and i in chosen]
        if origs:
            keep += ix if with_edits else origs
    keep.sort()
    return data.subset(keep)


def with_label_noise(data: CadData, rate: float, seed: int = 0) -> Tuple[CadData, List[int]]:
    """A copy of `data` with ``round(rate * len(data))`` labels, drawn with ``random.Random(seed)``, each replaced by
    another class drawn uniformly (the noisy-label scenario). Returns (the noisy data, the indices flipped)."""
    if not 0 <= rate < 1:
        raise DataError(f"--label-noise must be in [0, 1), got {rate}")
    if data.num_labels < 2:
        raise DataError("--label-noise needs at least two classes")
    rng = random.Random(seed)
    flipped = sorted(rng.sample(range(len(data)), round(rate * len(data))))
    labels = list(data.labels)
    for i in flipped:
        labels[i] = rng.choice([c for c in range(data.num_labels) if c != labels[i]])
    return replace(data, labels=labels, ids=list(data.ids)), flipped


def long_tail(data: CadData, label: str, fraction: float, seed: int = 0) -> CadData:
    """`data` with only ``ceil(fraction * n)`` of the n examples of class `label` kept (drawn with
    ``random.Random(seed)``; order kept): the long-tail scenario."""
    if label not in data.label_names:
        raise DataError(f"--long-tail: {label!r} is not a label of the data ({', '.join(data.label_names)})")
    if not 0 < fraction <= 1:
        raise DataError(f"--long-tail: the fraction must be in (0, 1], got {fraction}")
    c = data.label_names.index(label)
    members = [i for i in range(len(data)) if data.labels[i] == c]
    keep = set(random.Random(seed).sample(members, math.ceil(fraction * len(members))))
    return data.subset([i for i in range(len(data)) if data.labels[i] != c or i in keep])


def metadata_from_cad(dev, per_class: int, seed: int = 0):
    """CLP's metadata from a CAD split: `per_class` originals of each class drawn with their edits (the edits are
    the counterfactual augmentation: each changes the label by construction), then every class cut to the smallest
    class's count (a balanced set). CAD has no label-preserving (factual) edits: the original pairs stand in for
    them. Returns (metadata, the rest of `dev`: the groups not drawn, for an uncontaminated dev score)."""
    drawn = few_shot(dev, per_class, seed=seed, with_edits=True)
    by_class = {}
    for i, y in enumerate(drawn.labels):
        by_class.setdefault(y, []).append(i)
    n = min(len(v) for v in by_class.values())
    rng = random.Random(seed)
    keep = sorted(i for v in by_class.values() for i in rng.sample(v, n))
    used = set(drawn.ids)
    rest = [i for i in range(len(dev)) if dev.ids[i] not in used]
    return drawn.subset(keep), dev.subset(rest)
