"""The 16-bit copies of a Bert-layout layer's projection weights that a pass under autocast multiplies with, made in
one launch and shared by the passes of one step.

``weights(layer, params, dtype)`` returns `Weights16`: the query, key and value weights stacked (the fused
projection's [3D, D] weight) and their biases stacked, then the attention output, intermediate and output
projections' weights and biases, all views of one buffer filled by one ``torch._foreach_copy_`` (one kernel for the
twelve casts on CUDA). Inside ``shared()`` — a step that runs several passes over the same weights (CAT: the clean
forward, the CAL steps and the counterfactual pass) — a layer's copies are made once and reused while they are
still what a new cast would give: the same parameters, unchanged since (version counters and storage), in the same
CUDA-graph capture state. `models.graph_capture` empties the shared copies before and after a capture, as it does
autocast's cache: a graph must not read memory that eager code made (a replay would read whatever is there then),
and eager code must not read memory that a graph owns.

``additive_mask(mask, dtype)`` is the same for a boolean attention mask: SDPA's additive form of it (0 where a query
attends a key, -inf elsewhere), which SDPA would otherwise build inside every call (a `where` over [B, 1, T, T],
19 calls in a CAT step), made once per step inside ``shared()``.
"""
from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

import torch

__all__ = ["Weights16", "weights", "additive_mask", "shared", "clear"]


class Weights16(NamedTuple):
    qkv: torch.Tensor  # [Dq + Dk + Dv, D]: query, key and value weights stacked
    qkv_bias: torch.Tensor
    attention_output: torch.Tensor
    attention_output_bias: torch.Tensor
    intermediate: torch.Tensor
    intermediate_bias: torch.Tensor
    output: torch.Tensor
    output_bias: torch.Tensor


_ALIGN = 64  # elements: each view starts on a 128-byte boundary (16-bit), as the matmul kernels prefer
_state = threading.local()


def _cast(params, dtype) -> Weights16:
    wq, wk, wv, bq, bk, bv, wo, bo, wi, bi, wo2, bo2 = params
    if wq.dtype == dtype:  # no cast: the parameters themselves, query, key and value stacked
        return Weights16(torch.cat((wq, wk, wv)).detach(), torch.cat((bq, bk, bv)).detach(),
                         *(p.detach() for p in (wo, bo, wi, bi, wo2, bo2)))
    groups = ((wq, wk, wv), (bq, bk, bv), (wo,), (bo,), (wi,), (bi,), (wo2,), (bo2,))
    starts, total = [], 0
    for group in groups:
        starts.append(total)
        total += -(-sum(p.numel() for p in group) // _ALIGN) * _ALIGN
    buffer = torch.empty(total, device=wq.device, dtype=dtype)
    views, sources = [], []
    for start, group in zip(starts, groups):
        offset = start
        for p in group:
            sources.append(p.detach())
            views.append(buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
    torch._foreach_copy_(views, sources)
    rows = wq.shape[0] + wk.shape[0] + wv.shape[0]
    n_qkv = wq.numel() + wk.numel() + wv.numel()
    qkv = buffer[:n_qkv].view(rows, wq.shape[1])
    qkv_bias = buffer[starts[1]:starts[1] + rows]
    return Weights16(qkv, qkv_bias, *views[6:])


def _reused(key, owner, stamp, make):
    """``make()``; inside `shared`, the result stored under `key` while `owner` and ``stamp()`` are what they were
    when it was made (else made again and stored)."""
    entries = getattr(_state, "entries", None)
    if entries is None:
        return make()
    now = stamp()
    hit = entries.get(key)
    if hit is not None and hit[0] == now and hit[1] is owner:
        return hit[2]
    made = make()
    entries[key] = (now, owner, made)
    return made


def _stamp(params):
    capturing = params[0].is_cuda and torch.cuda.is_current_stream_capturing()
    return capturing, tuple((p._version, p.data_ptr()) for p in params)


def weights(layer, params, dtype) -> Weights16:
    """The `dtype` copies of `params` — ``(query W, key W, value W, query b, key b, value b, attention output W, b,
    intermediate W, b, output W, b)`` of `layer`, one dtype and device — made now, or inside `shared` reused from an
    earlier pass of the step when still valid (module docstring). Detached: no gradient flows through them."""
    # weights made for this pass (a LoRA projection's W + s·BA, `layout.projection`) stamp as a new object: not reused
    parameters = all(isinstance(p, torch.nn.Parameter) for p in params)
    return _reused((id(layer), dtype), layer, (lambda: _stamp(params)) if parameters else object,
                   lambda: _cast(params, dtype))


def _additive(mask, dtype):
    return torch.full(mask.shape, float("-inf"), dtype=dtype, device=mask.device).masked_fill_(mask, 0.0)


def additive_mask(mask: torch.Tensor, dtype) -> torch.Tensor:
    """SDPA's additive form of the boolean attention `mask` (True attends) in `dtype`: SDPA gives the same with it
    as with the mask itself. Made now, or inside `shared` reused while the mask is unchanged (its version counter
    and storage) and in the same capture state (module docstring)."""
    return _reused(("mask", id(mask), dtype), mask, lambda: _stamp((mask,)), lambda: _additive(mask, dtype))


@contextlib.contextmanager
def shared():
    """While inside (in this thread), `weights` reuses a layer's copies across passes (module docstring); nested
    uses share the outermost one's."""
    if getattr(_state, "entries", None) is not None:
        yield
        return
    _state.entries = {}
    try:
        yield
    finally:
        _state.entries = None


def clear():
    """Forget the shared copies made so far (inside `shared`; elsewhere nothing)."""
    if getattr(_state, "entries", None) is not None:
        _state.entries = {}
