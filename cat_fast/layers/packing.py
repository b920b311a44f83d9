"""The non-padding rows of a batch, for the training layer's packed path (`layers.training`, ``PACKED``): the
row-wise work (projections, dropout, residual adds, LayerNorms, the feed-forward block) runs on the N real rows of
``hidden.reshape(-1, D)`` only; the attention runs in the padded [B, T] layout, its padding rows zero.

``real_rows(mask, B, T, min_padding)`` reads the real tokens from a key-padding attention mask (boolean, True attends, or
additive, 0 attends and -inf or the dtype's minimum masks, [B or 1, 1, T or 1, T], the same key pattern on every
query row) and returns their row indices, or None where it cannot (another mask form: the padded path runs) or where
fewer than `min_padding` of the rows are padding. One host synchronisation per mask: the result is remembered for
the last mask tensor while it is alive and unchanged (its version counter), so the layers of one forward share it.
``attend`` and ``attention_backward`` run the attention of N packed projection rows in the padded layout and
differentiate it; ``scatter`` writes N rows into a copy of the full rows.

Static row counts, for CUDA graphs (`cat_fast.step.CapturedStep`), whose shapes cannot depend on the data: inside
``static_rows(n)``, `real_rows` returns n indices computed on the device without a host synchronisation: the real
rows ascending, then padding rows up to n (computed as the padded path computes them: the same values there), with a
device-side assertion that no real row is left out (`torch._assert_async`: a loud failure, never a dropped row); the
mask's values (every query row the first, additive entries 0 or masking) are asserted on the device the same way.
``bucket(n_real, total, min_padding)`` rounds a real-row count up to eighths of the rows, so that a run sees a
handful of graphs.
"""
from __future__ import annotations

import contextlib
import math
import threading
import weakref

import torch
import torch.nn.functional as F

__all__ = ["real_rows", "attend", "attention_backward", "scatter", "static_rows", "static_count", "bucket", "BUCKETS"]

_last = threading.local()  # .entry: (weak reference to the mask, its version, (B, T, min_padding), the result)
_static = threading.local()  # .rows: `static_rows`'s n, or None
BUCKETS = 8  # a step's real-row count is rounded up to a multiple of 1/BUCKETS of its rows


@contextlib.contextmanager
def static_rows(n: int | None):
    """Within: `real_rows` returns `n` rows computed on the device (module docstring); None: as outside."""
    saved = getattr(_static, "rows", None)
    _static.rows = n
    try:
        yield
    finally:
        _static.rows = saved


def static_count() -> int | None:
    """`static_rows`'s n where one is set, else None."""
    return getattr(_static, "rows", None)


def bucket(n_real: int, total: int, min_padding: float) -> int | None:
    """`n_real` rounded up to a multiple of ``ceil(total / BUCKETS)`` (at most `total`), or None where the rounded
    count leaves fewer than `min_padding` of the `total` rows padding, or there is no real row (the padded path)."""
    if n_real <= 0 or total <= 0:
        return None
    step = math.ceil(total / BUCKETS)
    n = min(total, math.ceil(n_real / step) * step)
    return n if n <= (1.0 - min_padding) * total else None


def _real_keys(mask: torch.Tensor, B: int, T: int):
    """``(real, ok)``: the [B, T] boolean real-token mask read from the key-padding mask `mask`, and a 0-d boolean
    tensor (or None: nothing to check) saying whether every query row repeats the first and every additive entry is
    0 or masking; None when the mask's shape or dtype is of another form (module docstring)."""
    if (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, B) or mask.shape[2] not in (1, T)
            or mask.shape[3] != T):
        return None
    keys = mask[:, :, :1, :]
    if mask.dtype == torch.bool:
        real, checks = keys, []
    elif mask.is_floating_point():
        real = keys == 0
        checks = [(real | (keys == float("-inf")) | (keys == torch.finfo(mask.dtype).min)).all()]
    else:
        return None
    if mask.shape[2] > 1:
        checks.append((mask == keys).all())
    return real[:, 0, 0, :].expand(B, T), (torch.stack(checks).all() if checks else None)


def real_rows(mask: torch.Tensor | None, B: int, T: int, min_padding: float) -> torch.Tensor | None:
    """Indices (int64, ascending) of the real rows of ``hidden.reshape(B * T, D)`` that `mask` marks, or None: no
    mask, a mask of another form, no real row, or padding on fewer than `min_padding` of the B·T rows."""
    if mask is None:
        return None
    n = static_count()
    entry = getattr(_last, "entry", None)
    key = (B, T, min_padding, n)
    if entry is not None and entry[0]() is mask and entry[1] == mask._version and entry[2] == key:
        return entry[3]
    found = _real_keys(mask, B, T)
    idx = None
    if n is not None:
        if found is not None and n < B * T:
            idx = _static_real_rows(*found, n)
    elif found is not None:
        real, ok = found
        if ok is None or bool(ok):
            idx = real.reshape(-1).nonzero().squeeze(1)
            if idx.numel() == 0 or idx.numel() > (1.0 - min_padding) * B * T:
                idx = None
    _last.entry = (weakref.ref(mask), mask._version, key, idx)
    return idx


def _static_real_rows(real: torch.Tensor, ok: torch.Tensor | None, n: int) -> torch.Tensor:
    """`n` row indices, the real rows of the [B, T] mask `real` first (ascending), then padding rows (ascending); on
    the device, asserting there that the real rows number at most `n` and that the mask is a key-padding mask (`ok`,
    `_real_keys`'s check)."""
    flat = real.reshape(-1)
    if ok is not None:
        torch._assert_async(ok)
    torch._assert_async(flat.sum() <= n)
    return torch.sort((~flat).to(torch.uint8), stable=True).indices[:n]


def attend(qkv_leaf, shape, attn_mask, p, scale, idx):
    """``(graph output, its rows)`` of the attention over the projections `qkv_leaf` (rows of ``[q | k | v]``, a
    leaf that requires grad): the padded layout's ``[B, heads, T, width]`` context and its detached
    ``[B·T, heads·width]`` rows when `idx` is None; else `qkv_leaf` holds the `idx` rows only, the others are zero
    (masked keys; padding queries nobody reads), and both are the context's `idx` rows ``[N, heads·width]``."""
    B, T, heads, width = shape
    with torch.enable_grad():
        full = qkv_leaf
        if idx is not None:
            full = qkv_leaf.new_zeros(B * T, qkv_leaf.shape[1]).index_copy(0, idx, qkv_leaf)
        q, k, v = (t.view(B, T, heads, width).transpose(1, 2) for t in full.split(heads * width, dim=1))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p, scale=scale)
        if idx is None:
            return context, context.detach().transpose(1, 2).reshape(-1, heads * width)
        rows = context.transpose(1, 2).reshape(B * T, heads * width).index_select(0, idx)
    return rows, rows.detach()


def attention_backward(out, qkv_leaf, grad_rows, shape, packed: bool):
    """The gradient w.r.t. `qkv_leaf` of `attend`'s graph output `out`, given the gradient of its rows."""
    B, T, heads, width = shape
    grad = grad_rows if packed else grad_rows.view(B, T, heads, width).transpose(1, 2)
    # retained: this one-node graph is freed with the saved tensors (a retain_graph backward can run again)
    (grad_qkv,) = torch.autograd.grad(out, qkv_leaf, grad, retain_graph=True)
    return grad_qkv


def scatter(full: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A copy of `full` [B·T, D] in `rows`' dtype with its `idx` rows replaced by `rows` [N, D]."""
    return full.to(rows.dtype).index_copy(0, idx, rows)
