"""The fast path of `mediation.neuron_effects`: copies of a batch with one neuron edited each, computing only what
the edit changes.

An edit at token 0 of layer ℓ's query, attention output, intermediate or output changes row 0 of layer ℓ's output
only ("row-0 form": the clean rows plus one edited row 0 per copy, [K, b, D]); an edit of its key or value changes
every row ("full form": [K·b, t, D]). The clean activations of layers ℓ and ℓ+1 come from one recorded forward per
(batch, layer) (`record`); copies compute only what the edit changes, with the layer's own modules called in pieces
(`models.families.layer_pieces`: the family's table entry says which; so autocast, the activation, LayerNorm eps and
the attention scaling are the model's); layers ℓ+2.. and the head run the model via `models.resume`.
`mediation_flops.sweep_flops` counts the matmuls.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .. import models
from ..models import families
from .mediation_effects import Key

__all__ = ["Interventions", "Clean", "record", "fast_logits"]


class Interventions:
    """Several `models.intervene` blocks at once: [((layer, component), fn), ...]."""

    def __init__(self, model, items):
        self.model, self.items, self.stack = model, items, []

    def __enter__(self):
        for (layer, comp), fn in self.items:
            cm = models.intervene(self.model, layer, comp, fn)
            cm.__enter__()
            self.stack.append(cm)
        return self

    def __exit__(self, *exc):
        while self.stack:
            self.stack.pop().__exit__(*exc)
        return False


@dataclass
class Clean:
    """The clean forward of one batch around layer ℓ (`record`)."""

    layer: int
    cap: models.Capture  # at layer min(ℓ + 1, L): resume from h_{ℓ+1} (ℓ + 1 < L) or run the head (h_L)
    x: torch.Tensor  # input of layer ℓ [b, t, D]
    mask: Optional[torch.Tensor]  # layer ℓ's 4-D attention mask ([b, 1, 1 or t, t]) or None
    z: Dict[str, torch.Tensor]  # layer ℓ's components [b, t, width]
    x1: Optional[torch.Tensor] = None  # input of layer ℓ + 1
    mask1: Optional[torch.Tensor] = None
    z1: Dict[str, torch.Tensor] = field(default_factory=dict)  # layer ℓ + 1's query, key, value

    @property
    def last(self):
        return self.cap.layer  # L when ℓ >= L − 1


def _recorder(store, key):
    def fn(x):
        store[key] = x
        return x

    return fn


def record(model, batch, layer) -> Optional[Clean]:
    """One forward of `batch` (`models.capture` at layer min(ℓ + 1, L)) recording the inputs, masks and components
    of layers ℓ and ℓ + 1; None when a layer call passes what the fast path does not handle."""
    st = models.structure(model)
    L = st.num_layers
    nxt = layer + 1 if layer < L else None
    calls: Dict[int, object] = {}

    def pre(j):
        def hook(mod, args, kwargs):
            calls[j] = families.call_arguments(args, kwargs)

        return hook

    store: Dict[Key, torch.Tensor] = {}
    wanted = [(layer, c) for c in models.COMPONENTS] + ([(nxt, c) for c in ("query", "key", "value")] if nxt else [])
    handles = [st.layer_modules[j - 1].register_forward_pre_hook(pre(j), with_kwargs=True)
               for j in ((layer, nxt) if nxt else (layer,))]
    try:
        with Interventions(model, [(key, _recorder(store, key)) for key in wanted]):
            cap = models.capture(model, batch, min(layer + 1, L), rng=False)
    finally:
        for h in handles:
            h.remove()
    if any(calls.get(j) is None for j in ((layer, nxt) if nxt else (layer,))) or len(store) != len(wanted):
        return None
    x, mask = calls[layer]
    clean = Clean(layer, cap, x, _key_mask(mask), {c: store[(layer, c)] for c in models.COMPONENTS})
    if nxt:
        clean.x1, mask1 = calls[nxt]
        clean.mask1 = _key_mask(mask1)
        clean.z1 = {c: store[(nxt, c)] for c in ("query", "key", "value")}
    return clean


def _key_mask(mask):
    """`mask` as [b, 1, 1, t] when every query row of it is the same (padding masks), else unchanged."""
    if mask is not None and mask.shape[-2] > 1 and torch.equal(mask, mask[:, :, :1].expand_as(mask)):
        return mask[:, :, :1]
    return mask


def _first_row_mask(mask):
    return mask if mask is None or mask.shape[-2] == 1 else mask[:, :, :1]


def _tile(x, k):
    """[b, ...] -> [k·b, ...]: k copies along the batch (copy-major, as `models.resume(repeat=k)`)."""
    return None if x is None else x.repeat(k, *([1] * (x.dim() - 1)))


def _copies(x, idx, values):
    """Row 0 of x [b, t, w] for k = len(idx) copies [k, b, w], copy j with its neuron idx[j] set to values[j]."""
    rows = x[:, 0].unsqueeze(0).repeat(idx.numel(), 1, 1)
    rows[torch.arange(idx.numel(), device=x.device), :, idx] = values.to(rows.dtype)[:, None]
    return rows


def _with_row0(x, row0):
    """x [b, t, w] tiled for the copies of row0 [k, b, w], row 0 of copy j replaced: [k·b, t, w]."""
    k = row0.shape[0]
    out = x.unsqueeze(0).repeat(k, 1, 1, 1)
    out[:, :, 0] = row0.to(out.dtype)
    return out.view(k * x.shape[0], *x.shape[1:])


def fast_logits(model, ops: List[families.Pieces], clean: Clean, comp, idx, values, prune):
    """Logits [k·b, C] of the k = len(idx) copies of the batch, copy j with neuron idx[j] of layer ℓ's `comp` set to
    values[j] at token 0 (`ops`: every layer's `families.Pieces`; `prune`: the head reads row 0 of the last layer
    only)."""
    layer, L = clean.layer, len(ops)
    op, z, x, mask = ops[layer - 1], clean.z, clean.x, clean.mask
    k, (b, t, _) = idx.numel(), x.shape
    if comp == "output":
        return _after_row0(model, ops, clean, _copies(z["output"], idx, values), prune)
    if comp == "intermediate":
        rows = _copies(z["intermediate"], idx, values)
        return _after_row0(model, ops, clean, op.output(rows, z["attention_output"][:, 0]), prune)
    if comp == "attention_output":
        a = _copies(z["attention_output"], idx, values)
        return _after_row0(model, ops, clean, op.output(op.intermediate(a), a), prune)
    if comp == "query":  # the copies' edited queries are k query rows of each sample against its clean keys
        q = _copies(z["query"], idx, values).transpose(0, 1)  # [b, k, D]
        context = op.attend(q, z["key"], z["value"], _first_row_mask(mask)).transpose(0, 1)  # [k, b, D]
        return _after_row0(model, ops, clean, op.finish(context, x[:, 0]), prune)
    # key / value: every row attends to the edited row 0
    kv = {c: _tile(z[c], k) for c in ("key", "value") if c != comp}
    kv[comp] = _with_row0(z[comp], _copies(z[comp], idx, values))
    if layer == L and prune:  # only row 0 reaches the head
        context = op.attend(_tile(z["query"][:, :1], k), kv["key"], kv["value"], _tile(_first_row_mask(mask), k))
        row0 = op.finish(context.view(k, b, 1, -1), x[:, :1]).view(k, b, -1)
        return _head(model, clean, _with_row0(clean.cap.hidden, row0))
    context = op.attend(_tile(z["query"], k), kv["key"], kv["value"], _tile(mask, k))
    h = op.finish(context.view(k, b, t, -1), x).view(k * b, t, -1)
    return _after_full(model, ops, clean, layer, h, prune)


def _after_row0(model, ops, clean: Clean, row0, prune):
    """Logits from layer ℓ's output in row-0 form (row0 [k, b, D], the other rows clean)."""
    layer, L = clean.layer, len(ops)
    if layer == L:
        return _head(model, clean, _with_row0(clean.cap.hidden, row0))
    op, z1, mask1 = ops[layer], clean.z1, clean.mask1  # layer ℓ + 1: rows >= 1 project as in the clean forward
    k, b = row0.shape[:2]
    keys, vals = _with_row0(z1["key"], op.key(row0)), _with_row0(z1["value"], op.value(row0))
    if layer + 1 == L and prune:
        q = op.query(row0).reshape(k * b, 1, -1)
        context = op.attend(q, keys, vals, _tile(_first_row_mask(mask1), k))
        out = op.finish(context, row0.reshape(k * b, 1, -1)).view(k, b, -1)
        return _head(model, clean, _with_row0(clean.cap.hidden, out))
    context = op.attend(_with_row0(z1["query"], op.query(row0)), keys, vals, _tile(mask1, k))
    h = op.finish(context, _with_row0(clean.x1, row0))
    return _after_full(model, ops, clean, layer + 1, h, prune)


def _after_full(model, ops, clean: Clean, m, h, prune):
    """Logits from the output of layer m (ℓ or ℓ + 1) in full form, h [k·b, t, D]."""
    L, k = len(ops), h.shape[0] // clean.x.shape[0]
    if m < clean.last:  # m = ℓ: run layer ℓ + 1 on every row (its input differs everywhere)
        op, mask1 = ops[m], clean.mask1
        if m + 1 == L and prune:
            context = op.attend(op.query(h[:, :1]), op.key(h), op.value(h), _tile(_first_row_mask(mask1), k))
            out = op.finish(context, h[:, :1]).view(k, -1, h.shape[-1])
            return _head(model, clean, _with_row0(clean.cap.hidden, out))
        h = op.finish(op.attend(op.query(h), op.key(h), op.value(h), _tile(mask1, k)), h)
        m += 1
    if m == L:
        return _head(model, clean, h)
    return models.logits_of(models.resume(model, clean.cap, h, first_token=prune, repeat=k))


def _head(model, clean: Clean, h):
    """The model's own head on h_L stacked for the copies ([k·b, t, D])."""
    k = h.shape[0] // clean.x.shape[0]
    return models.logits_of(models.resume(model, clean.cap, h, repeat=k))
