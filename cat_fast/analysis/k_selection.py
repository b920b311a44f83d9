"""How many neurons to mask (docs/METHODS.md §3): sweep k over a grid, score the masked model on held-out sets, and
choose k by a stated rule. One model, masked in place for each k (`cat_fast.analysis.masking`), never reloaded.

    from cat_fast.analysis import k_selection
    grid = k_selection.parse_grid("0.5%,1%,2%", swept=nie.flat()[0].numel())    # [k, ...], 0 first
    curve = k_selection.k_curve(model, nie.top(max(grid)), grid, {"dev": dev_batches, "anti": anti_batches})
    rule = k_selection.parse_rule("max-drop:3")                                 # or "best-on:anti"
    k = k_selection.choose_k(curve, rule, on="dev")

``curve`` is a list of ``{"k": k, "accuracy": {set name: accuracy}}`` in increasing k, k = 0 first (the unmasked
model). Rules: ``max-drop:D``: the largest k such that the accuracy on the set stays within D points (percent) of
k = 0 for that k and every smaller k of the grid; ``best-on``: the k of the best accuracy on the set, the smallest
such k on ties. A geometric grid leaves a wide gap above the k max-drop picks (the next k of the grid doubles it):
`refine_max_drop` bisects that gap, scoring a few more k (``"refined": True`` in the curve), so that the choice is
the largest k within the drop to a fraction of the gap.

    curve = k_selection.refine_max_drop(model, ranked, curve, rule, "dev", sets, steps=3)
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence

import torch

__all__ = ["DEFAULT_GRID", "REFINE_STEPS", "Rule", "parse_grid", "parse_rule", "masked", "accuracy", "k_curve",
           "choose_k", "bisect_largest", "refine_max_drop"]

DEFAULT_GRID = "0.25%,0.5%,1%,2%,4%,8%"  # geometric, about the paper's 700 of 82,944 (0.84 %) to beyond its 5 %
REFINE_STEPS = 3  # bisections of the gap above the k max-drop picks on the grid: to an eighth of it


@dataclass(frozen=True)
class Rule:
    """``kind`` "max-drop" (``value``: the drop allowed, in points) or "best-on" (``value``: the set's name)."""

    kind: str
    value: object

    def __str__(self) -> str:
        return f"{self.kind}:{self.value}"


def parse_grid(spec: str, swept: int) -> List[int]:
    """``"0.25%,1%,50"`` -> sorted distinct k (a percentage of the `swept` neurons, rounded, at least 1; or a
    number), with 0 first. A k above `swept` or a malformed item is a ``ValueError`` naming it."""
    ks = {0}
    for item in (s.strip() for s in str(spec).split(",")):
        if not item:
            continue
        try:
            if item.endswith("%"):
                share = float(item[:-1])
                if not (math.isfinite(share) and 0 < share <= 100):
                    raise ValueError
                k = max(1, round(swept * share / 100))
            else:
                k = int(item)
                if k < 1:
                    raise ValueError
        except ValueError:
            raise ValueError(f"k grid item {item!r}: expected a percentage in (0%, 100%] of the neurons swept or a "
                             f"whole number >= 1") from None
        if k > swept:
            raise ValueError(f"k grid item {item!r}: {k} is larger than the {swept} neurons swept")
        ks.add(k)
    if len(ks) < 2:
        raise ValueError(f"k grid {spec!r}: expected at least one k, e.g. {DEFAULT_GRID}")
    return sorted(ks)


def parse_rule(spec: str) -> Rule:
    """``"max-drop"`` / ``"max-drop:D"`` (D points, default 3) or ``"best-on:NAME"``."""
    kind, _, value = str(spec).partition(":")
    if kind == "max-drop":
        try:
            drop = float(value) if value else 3.0
        except ValueError:
            drop = math.nan
        if not (math.isfinite(drop) and drop >= 0):
            raise ValueError(f"k rule {spec!r}: expected max-drop:D with D a number of points >= 0 (e.g. max-drop:3)")
        return Rule("max-drop", drop)
    if kind == "best-on" and value:
        return Rule("best-on", value)
    raise ValueError(f"k rule {spec!r}: expected max-drop:D (points of accuracy) or best-on:FILE")


@contextlib.contextmanager
def masked(model, neurons: Sequence, factor: float = 0.0, rescale: bool = False):
    """`model` with `neurons` masked inside the block (none: unmasked), unmasked after it."""
    from . import masking

    try:
        if len(neurons):
            masking.mask_neurons(model, neurons, factor, rescale=rescale)
        else:
            masking.unmask_neurons(model)
        yield model
    finally:
        masking.unmask_neurons(model)


@torch.no_grad()
def accuracy(model, batches: Iterable[Dict[str, torch.Tensor]]) -> float:
    """The share of examples whose argmax logit is their ``labels`` (batches of model inputs and ``labels``)."""
    right = total = 0
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            pred = model(**inputs).logits.argmax(-1)
            right += int((pred == batch["labels"].to(pred.device)).sum())
            total += int(batch["labels"].numel())
    finally:
        model.train(was_training)
    if total == 0:
        raise ValueError("accuracy: no examples")
    return right / total


def k_curve(model, ranked: Sequence, grid: Sequence[int], sets: Dict[str, List[Dict[str, torch.Tensor]]],
            factor: float = 0.0, rescale: bool = False) -> List[Dict]:
    """The accuracy on each of `sets` (name -> batches) with the first k of `ranked` (neurons, best first) masked,
    for each k of `grid` (increasing; 0: the unmasked model). `model` is left unmasked."""
    grid = sorted(set(int(k) for k in grid))
    if grid and grid[-1] > len(ranked):
        raise ValueError(f"k {grid[-1]} is larger than the {len(ranked)} neurons ranked")
    curve = []
    for k in grid:
        with masked(model, list(ranked[:k]), factor, rescale):
            curve.append({"k": k, "accuracy": {name: accuracy(model, batches) for name, batches in sets.items()}})
    return curve


def choose_k(curve: Sequence[Dict], rule: Rule, on: str) -> int:
    """The k that `rule` picks on the set named `on` of `curve` (`k_curve`'s list, k = 0 first)."""
    if not curve or curve[0]["k"] != 0:
        raise ValueError("choose_k: expected a curve starting at k = 0 (the unmasked model)")
    scores = [(point["k"], point["accuracy"][on]) for point in curve]
    if rule.kind == "max-drop":
        base = scores[0][1]
        chosen = 0
        for k, acc in scores:
            if 100 * (base - acc) > rule.value + 1e-9:
                break
            chosen = k
        return chosen
    if rule.kind == "best-on":
        best = max(acc for _, acc in scores)
        return min(k for k, acc in scores if acc == best)
    raise ValueError(f"choose_k: unknown rule {rule}")


def bisect_largest(lo: int, hi: int, passes, steps: int) -> List[int]:
    """The k scored by `steps` bisections of ``(lo, hi)`` for the largest k that `passes` (a callable k -> bool;
    `lo` passes, `hi` does not), in the order scored; stops early once no whole k lies between."""
    scored = []
    for _ in range(steps):
        mid = (lo + hi) // 2
        if mid <= lo:
            break
        scored.append(mid)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return scored


def refine_max_drop(model, ranked: Sequence, curve: Sequence[Dict], rule: Rule, on: str,
                    sets: Dict[str, List[Dict[str, torch.Tensor]]], steps: int = REFINE_STEPS, factor: float = 0.0,
                    rescale: bool = False) -> List[Dict]:
    """`curve` with the k that `steps` bisections score between the k that `rule` (max-drop) picks and the next k of
    the curve (which fails it), each scored on every set and marked ``"refined": True``; sorted by k. Unchanged when
    the rule is not max-drop or the pick is the curve's last k. `choose_k` on the result picks the largest k found."""
    if rule.kind != "max-drop":
        return list(curve)
    ks = [point["k"] for point in curve]
    lo = choose_k(curve, rule, on)
    if lo == ks[-1]:
        return list(curve)
    hi = ks[ks.index(lo) + 1]
    base = curve[0]["accuracy"][on]
    added = []

    def passes(k):
        with masked(model, list(ranked[:k]), factor, rescale):
            point = {"k": k, "accuracy": {name: accuracy(model, batches) for name, batches in sets.items()},
                     "refined": True}
        added.append(point)
        return 100 * (base - point["accuracy"][on]) <= rule.value + 1e-9

    bisect_largest(lo, hi, passes, steps)  # every k below hi, a k of the curve that `k_curve` ranked
    return sorted(list(curve) + added, key=lambda point: point["k"])
