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

``ahead(layers, params_of, rows)``: while inside (the fast layers' forward, `models.fast_layers.training_layers`),
for forwards of at most `AHEAD_MAX_ROWS` rows, making or reusing a layer's copies on CUDA starts the next layer's
cast on a side stream, where it runs beside this layer's kernels, when that layer took its copies from `weights` in
its last scope (a layer that runs the model's own modules, as a first-token last layer does in training, is not
cast for nothing); the next layer's `weights` then waits for it (or casts anew if a parameter changed since). The
same kernel on the same parameters: the same copies. `AHEAD = False` turns it off, for comparisons.

``additive_mask(mask, dtype)`` is the same for a boolean attention mask: SDPA's additive form of it (0 where a query
attends a key, -inf elsewhere), which SDPA would otherwise build inside every call (a `where` over [B, 1, T, T],
19 calls in a CAT step), made once per step inside ``shared()``.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import NamedTuple

import torch

__all__ = ["Weights16", "weights", "additive_mask", "shared", "clear", "ahead", "AHEAD", "AHEAD_MAX_ROWS"]

# Whether `ahead` casts the next layer's weights on a side stream (module docstring); False casts each layer when it
# runs, as the benchmarks compare.
AHEAD = True
# The most rows (batch x length) of a forward that `ahead` casts ahead for: 8,192. Up to 32x128 the captured steps
# were measured faster with it; at 64x256 (16,384 rows, whose matmuls fill the GPU) no faster (benchmarks/RESULTS.md,
# "Each layer's weights cast while the layer before runs").
AHEAD_MAX_ROWS = 8192


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
    if _valid(entries, key, owner, now):
        return entries[key][2]
    made = make()
    entries[key] = (now, owner, made)
    return made


def _valid(store, key, owner, now) -> bool:
    """Whether `store` (a dict, or None) holds under `key` an entry ``(stamp, owner, copies, ...)`` of `owner`
    stamped `now`."""
    hit = None if store is None else store.get(key)
    return hit is not None and hit[0] == now and hit[1] is owner


def _take_started(key, owner, stamp):
    """The copies `ahead` started on its side stream for `key`, with the current stream made to wait for them, when
    `owner` and ``stamp()`` are still what they were then; else None (and the started copies are dropped)."""
    chain = getattr(_state, "chain", None)
    if not chain or not chain.started:
        return None
    hit = chain.started.pop(key, None)
    if hit is None or not _valid({key: hit}, key, owner, stamp()):
        return None
    torch.cuda.current_stream(hit[3].device).wait_stream(hit[3])
    return hit[2]


_SIDE_STREAMS: dict = {}
# The layers that called `weights` in their last `ahead` scope (their successors' casts start theirs ahead).
_TAKERS: "weakref.WeakSet" = weakref.WeakSet()


class _Chain:
    """The layers of an `ahead` scope: each one's successor, the side streams used and the copies started."""

    def __init__(self, layers, params_of, on):
        self.after = {id(a): b for a, b in zip(layers, layers[1:])} if on else {}
        self.members = frozenset(id(a) for a in layers)
        self.params_of = params_of
        self.started: dict = {}
        self.streams: dict = {}

    def start_after(self, layer, dtype):
        """Start the cast of `layer`'s successor to `dtype` on the device's side stream (module docstring) when it
        has one, its parameters are CUDA `Parameter`s of another dtype, and no valid copies exist for it yet."""
        nxt = self.after.get(id(layer))
        if nxt is None or not AHEAD or nxt not in _TAKERS:
            return
        try:
            params = tuple(self.params_of(nxt))
        except (AttributeError, TypeError):
            return
        first = params[0]
        if (not first.is_cuda or first.dtype == dtype
                or not all(isinstance(p, torch.nn.Parameter) and p.dtype == first.dtype and p.device == first.device
                           for p in params)):
            return
        key, now = (id(nxt), dtype), _stamp(params)
        if _valid(self.started, key, nxt, now) or _valid(getattr(_state, "entries", None), key, nxt, now):
            return
        side = _SIDE_STREAMS.get(first.device)
        if side is None:
            side = _SIDE_STREAMS[first.device] = torch.cuda.Stream(first.device)
        main = torch.cuda.current_stream(first.device)
        # the side stream's allocations follow all the work enqueued so far on this stream, so no memory it gets
        # from the caching allocator is still being read here; its copies are read here only after a wait
        side.wait_stream(main)
        with torch.cuda.stream(side):
            made = _cast(params, dtype)
        self.started[key] = (now, nxt, made, side)
        self.streams[first.device] = (main, side)

    def join(self):
        """Make each stream that started copies wait for its side stream (a capture must end joined), drop the
        copies not taken (their layers are no longer cast ahead until they take copies again)."""
        for hit in self.started.values():
            _TAKERS.discard(hit[1])
        for main, side in self.streams.values():
            main.wait_stream(side)
        self.started.clear()
        self.streams.clear()


@contextlib.contextmanager
def ahead(layers, params_of, rows: int | None = None):
    """While inside (in this thread), `weights` for one of `layers` (consecutive layers, run in that order) starts
    the next one's cast on a side stream (module docstring) where the forward has at most `AHEAD_MAX_ROWS` `rows`
    (None: not known, no bound); `params_of(layer)` gives a layer's twelve projection parameters in `weights`'s
    order. The scope ends joined: the current stream waits for the side stream. Nested uses: the innermost one's
    layers."""
    if AHEAD is not True and AHEAD is not False:
        raise ValueError(f"cat_fast.layers.casts.AHEAD: expected True or False, got {AHEAD!r}")
    if isinstance(AHEAD_MAX_ROWS, bool) or not isinstance(AHEAD_MAX_ROWS, int) or AHEAD_MAX_ROWS < 0:
        raise ValueError(f"cat_fast.layers.casts.AHEAD_MAX_ROWS: expected an integer >= 0, got {AHEAD_MAX_ROWS!r}")
    outer = getattr(_state, "chain", None)
    chain = _state.chain = _Chain(list(layers), params_of, rows is None or rows <= AHEAD_MAX_ROWS)
    try:
        yield
    finally:
        _state.chain = outer
        chain.join()


def _stamp(params):
    capturing = params[0].is_cuda and torch.cuda.is_current_stream_capturing()
    return capturing, tuple((p._version, p.data_ptr()) for p in params)


def weights(layer, params, dtype) -> Weights16:
    """The `dtype` copies of `params` — ``(query W, key W, value W, query b, key b, value b, attention output W, b,
    intermediate W, b, output W, b)`` of `layer`, one dtype and device — made now, or inside `shared` reused from an
    earlier pass of the step when still valid (module docstring). Detached: no gradient flows through them."""
    # weights made for this pass (a LoRA projection's W + s·BA, `layout.projection`) stamp as a new object: not reused
    parameters = all(isinstance(p, torch.nn.Parameter) for p in params)
    key, stamp = (id(layer), dtype), (lambda: _stamp(params)) if parameters else object
    started = _take_started(key, layer, stamp)  # inside `ahead`: the copies the side stream made, when still valid
    made = _reused(key, layer, stamp, (lambda: started) if started is not None else (lambda: _cast(params, dtype)))
    chain = getattr(_state, "chain", None)
    if chain is not None and id(layer) in chain.members:
        _TAKERS.add(layer)
        chain.start_after(layer, dtype)
    return made


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
