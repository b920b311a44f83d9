"""The non-padding rows of a batch, for the training layer's packed path (`layers.training`, ``PACKED``): the
row-wise work (projections, dropout, residual adds, LayerNorms, the feed-forward block) runs on the N real rows of
``hidden.reshape(-1, D)`` only; the attention by variable-length attention over the packed rows (`varlen_applies`:
CUDA, 16-bit; cat_fast's Triton kernels, or PyTorch's flash attention: `VARLEN_KERNEL`), else in the padded [B, T]
layout, its padding rows zero.

``plan(mask, B, T, min_padding)`` (`Plan`: the row indices, the varlen offsets) and ``real_rows`` (the indices)
read the real tokens from a key-padding attention mask (boolean, True attends, or additive, 0 attends and -inf or the
dtype's minimum masks, [B or 1, 1, T or 1, T], the same key pattern on every query row), or return None where they
cannot (another mask form, a sequence whose first position is padding: the padded path runs) or where fewer than
`min_padding` of the rows are padding. One host synchronisation per mask: the result is remembered for the last mask
tensor while it is alive and unchanged (its version counter), so the layers of one forward share it.
``attend`` and ``attention_backward`` run the attention of N packed projection rows and differentiate it (with
variable-length attention, the projections' bias gradient summed as dq, dk and dv are joined);
``pack`` and ``unpack`` (differentiable) gather the rows and write them back into a full tensor (an unpack given
its pack's node, ``link``, hands the full tensor's gradient to that pack, which writes its rows into it: one copy of
the full gradient); ``carry`` / ``carried`` mark a layer's packed output for the next layer within ``carrying``.

Static row counts, for CUDA graphs (`cat_fast.step.CapturedStep`), whose shapes cannot depend on the data: inside
``static_rows(n)``, `real_rows` returns n indices computed on the device without a host synchronisation: the real
rows ascending, then padding rows up to n (in the padded layout computed as the padded path computes them; by
variable-length attention as sequences of their own, which attend among themselves), with a device-side assertion
that no real row is left out (`torch._assert_async`: a loud failure, never a dropped row); the mask's values (every
query row the first, additive entries 0 or masking) and a real first position are asserted on the device the same
way.
``bucket(n_real, total, min_padding)`` rounds a real-row count up to a 32nd of the rows, so that a run sees a
handful of graphs.

Rows beyond the real ones (``extended(rows)``, CAT's CMIX): within, a plan packs the [B, T] boolean `rows` instead of
the mask's real tokens, which they must hold (else the padded path runs; on the device, an assertion); the keys are
still the mask's real tokens. A padding row so packed is computed as the padded path computes it (its query attends
to its sequence's real keys), which CMIX needs where a sample's partner is shorter than it. Every forward of the
step packs the same rows (the same dropout draws over them), whatever its mask: the counterfactual passes' masks
(`mask_mode`) only change the keys. Variable-length attention then takes the keys apart from the queries: the key
and value rows are gathered per call (`Plan.attention_layout`). ``extended(rows, after)`` with ``narrow()``: the
layers past CAT's mixing layer pack fewer rows (``after``: the rows of its mixed sequences; `KEYS`, each call's
real tokens, whose keys are then every packed row and need no gather), under the second count of a
``static_rows((n, n_after))`` pair; the lent padding rows are needed up to h_m only.

Lent rows apart (``lent(rows)``, `LENT`): where those padding rows take no gradient (CAT with its CRM weight
detached), the layers up to the narrowing pack the real rows only, as a plain step does, and each packed layer also
carries the lent rows forward without autograd (`layers.training`): their query attends to its sequence's keys (the
real rows' keys and values the layer computed), the rest of the layer row by row, as the padded path computes a
padding row. On CUDA, with variable-length attention, that work runs on a stream of its own from the layer's key
and value projection on, beside the rest of the layer (`LENT_LANE`). At the narrowing, `lent_rows` hands them over
and `with_lent` writes them into a detached copy of h_m. A static count's third number
(``static_rows((n, n_after, n_lent))``) is their count in a graph: the lent rows first, then rows whose results go
to a scratch row nobody reads.
"""
from __future__ import annotations

import contextlib
import math
import threading
import weakref

import torch
import torch.nn.functional as F

from ..ops.fused import fused_kernels
from .layout import will_run

__all__ = ["real_rows", "attend", "attention_backward", "scatter", "static_rows", "static_count", "bucket", "BUCKETS",
           "Plan", "plan", "pack", "link", "unpack", "carry", "carried", "carrying", "may_carry", "padded", "refused",
           "VARLEN", "VARLEN_KERNEL", "varlen_forward", "varlen_backward", "NARROW", "extended", "narrow", "KEYS",
           "LENT", "LENT_LANE", "lent", "lent_state", "lent_rows", "with_lent",
           "lent_bucket", "LENT_BUCKETS"]

_last = threading.local()  # .entry: (weak reference to the mask, its version, (B, T, min_padding, ...), the result,
# a weak reference to `extended`'s rows or None)
_static = threading.local()  # .rows: `static_rows`'s n, or None
# A step's real-row count is rounded up to a multiple of 1/BUCKETS of its rows: 32, so that the rows packed exceed
# the real ones by at most ~3 % of the batch (eighths had packed 7/8 of the rows for the step suite's 76 % real
# tokens) while a run's batches, whose real fraction varies little, see a few graphs.
BUCKETS = 32
# Whether packed rows attend by variable-length attention where it applies (`varlen_applies`); False
# attends in the padded layout (scatter, SDPA, gather), as the CPU does, for comparisons.
VARLEN = True
# Which variable-length attention packed rows attend by where it applies: "triton", cat_fast's own
# (`kernels.triton.varlen_attention`: its dropout mask written as bits from a key the device's generator draws),
# or "flash", PyTorch's flash attention (its dropout from the generator's Philox state).
VARLEN_KERNEL = "triton"
_carry = threading.local()  # .layers: the layers whose output may stay packed (`carrying`), or None
_refused = threading.local()  # .on: whether `padded` is in force
_extend = threading.local()  # .state: `extended`'s `_Extension`, or None
# Whether `narrow` takes effect; False packs `extended`'s rows through every layer, for comparisons.
NARROW = True
# Whether a step whose lent rows take no gradient computes them apart, forward only (`lent`, module docstring); False
# packs them with the real rows up to the narrowing, for comparisons.
LENT = True
# Whether, on CUDA, the packed layers run the lent rows' work on a stream of its own (`_Lent.lane`), from the
# layer's key and value projection on, beside the rest of the layer on the real rows: the lent rows' small products,
# attention and row-wise kernels fill the gaps and tails of the real rows' kernels instead of following them. Same
# kernels, same draws (issued in the same order); False runs them on the layer's stream, for comparisons.
LENT_LANE = True
_lent = threading.local()  # .state: `lent`'s `_Lent`, or None
_LANES: dict = {}  # device -> the stream the lent rows run on


@contextlib.contextmanager
def _scoped(store: threading.local, name: str, value):
    """Within: ``store.name`` is `value`; after, what it was (None where unset)."""
    saved = getattr(store, name, None)
    setattr(store, name, value)
    try:
        yield
    finally:
        setattr(store, name, saved)


def static_rows(n):
    """Within: `real_rows` returns `n` rows computed on the device (module docstring); None: as outside. `n` may
    be a pair ``(n, n_narrowed)``: the second is the row count of the plans made after `narrow`; or a triple
    ``(n, n_narrowed, n_lent)``: the third is `lent`'s row count."""
    if n is not None and not (isinstance(n, int) or (isinstance(n, tuple) and len(n) in (2, 3)
                                                      and all(isinstance(c, int) and c >= 0 for c in n))):
        raise ValueError(f"packing.static_rows: expected a row count, or a pair or triple of them, got {n!r}")
    return _scoped(_static, "rows", n)


def static_count():
    """`static_rows`'s value where one is set (a row count, or a pair of them), else None."""
    return getattr(_static, "rows", None)


def _static_counts():
    """``(n, n_narrowed)`` of `static_rows` (None, None where unset; n twice where one count was given)."""
    n = static_count()
    return n[:2] if isinstance(n, tuple) else (n, n)


def padded(on: bool = True):
    """Within (`on`): nothing is packed, whatever `layers.training.PACKED` says: the step of an objective whose
    passes could not pack alike (`Objective.packs_rows`), the eager steps of a padded graph's signature. A `padded`
    inside another keeps it in force."""
    return _scoped(_refused, "on", bool(on) or refused())


def refused() -> bool:
    """Whether `padded` is in force."""
    return bool(getattr(_refused, "on", False))


class _Extension:
    """`extended`'s rows: ``rows`` until `narrow`, then ``after`` (a [B, T] boolean tensor, or `KEYS`)."""

    __slots__ = ("rows", "after", "narrowed")

    def __init__(self, rows, after):
        self.rows, self.after, self.narrowed = rows, after, False

    def current(self):
        """The rows a plan packs now: a [B, T] boolean tensor, or None (the mask's real tokens)."""
        rows = self.after if self.narrowed else self.rows
        return None if rows is KEYS else rows


# `extended`'s `after` for the layers past the narrowing that pack the real tokens of each call's mask (its keys)
KEYS = "keys"


def _check_rows(name, rows, where="extended"):
    if rows is None or rows is KEYS:
        return
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.dtype != torch.bool:
        raise ValueError(f"packing.{where}: {name} must be a [B, T] boolean tensor, got "
                         f"{getattr(rows, 'dtype', type(rows).__name__)} of shape {tuple(getattr(rows, 'shape', ()))}")


def extended(rows: torch.Tensor | None, after=None):
    """Within: a plan of a [B, T] batch packs the rows `rows` marks ([B, T] boolean, holding every real token of
    the masks the layers get; or `KEYS`, the real tokens, where only `after` differs from them), not only the real
    ones (module docstring); None: as outside. `after`: the rows the
    plans made after `narrow` pack instead (a [B, T] boolean tensor within `rows`, or `KEYS`: each call's real
    tokens), under the second count of a `static_rows` pair: CAT's layers past the mixing layer, which need the rows
    of its mixed sequences only. None: `rows` throughout."""
    _check_rows("rows", rows)
    if after is not KEYS:
        _check_rows("after", after)
    return _scoped(_extend, "state", None if rows is None else _Extension(rows, after))


def narrow():
    """From here to the end of the `extended` block in force, plans pack its ``after`` rows (nothing where there is
    no such block, or it has no ``after``). CAT calls it where its clean forward reaches the mixing layer."""
    state = getattr(_extend, "state", None)
    if NARROW and state is not None and state.after is not None:
        state.narrowed = True


class _Lent:
    """`lent`'s state: `idx`, the rows carried (the lent ones ascending, then with a
    static count rows of no use); `dest`, where each is written back (its row, or B·T: a scratch row); `cu`, int32
    offsets of each sequence's lent rows, for the attention; `x` and `x16`, their hidden rows so far and a 16-bit
    copy of them (None before the first packed layer); `done`, set by `lent_rows`; `broken`, set by a layer that
    could not carry them; `joins`, the (stream, lane) pairs whose stream must wait for the lane, and `kept`, what
    the lane reads until then (`lane`)."""

    __slots__ = ("idx", "dest", "cu", "x", "x16", "done", "broken", "joins", "kept")

    def __init__(self, mask, idx, dest):
        """`mask`: the [B, T] rows lent; `idx` and `dest` as above."""
        self.idx, self.dest = idx, dest
        counts = mask.sum(1, dtype=torch.int32)
        self.cu = torch.cat([counts.new_zeros(1), counts.cumsum(0, dtype=torch.int32)])
        self.x = self.x16 = None
        self.done = self.broken = False
        self.joins, self.kept = {}, []

    def active(self) -> bool:
        """Whether a packed layer now carries the rows on (started, not yet handed over)."""
        return self.x is not None and not self.done

    def lane(self, keep):
        """The stream on which a layer runs the lent rows' work (`LENT_LANE`), made to wait for all the work issued
        so far on the current stream, or None (not CUDA, or off): call it once the layer's inputs of that work (its
        keys and values) are issued. `keep`: what that work reads of the current stream's making (tensors, and
        objects holding them), held here with the rows carried so far until the current stream waits for the lane
        (`lent_rows`, the end of `lent`): freed before, their memory could be handed out again on the current stream
        while the lane still reads it. What the lane makes is freed to the lane, whose work always starts after
        the current stream's work issued before it."""
        if LENT_LANE is not True and LENT_LANE is not False:
            raise ValueError(f"cat_fast.layers.packing.LENT_LANE: expected True or False, got {LENT_LANE!r}")
        if not LENT_LANE or self.x is None or not self.x.is_cuda:
            return None
        device = self.x.device
        lane = _LANES.get(device)
        if lane is None:
            lane = _LANES[device] = torch.cuda.Stream(device)
        main = torch.cuda.current_stream(device)
        lane.wait_stream(main)
        self.kept.extend((*keep, self.x, self.x16))
        self.joins[main] = lane
        return lane

    def join(self):
        """Make each stream the lane's work was issued from wait for the lane (a capture must end joined); then
        what `lane` kept may go."""
        for main, lane in self.joins.items():
            main.wait_stream(lane)
        self.joins.clear()
        self.kept.clear()


# The lent rows' static count is rounded up to a multiple of 1/LENT_BUCKETS of the batch's rows: their number
# follows each step's partner draw (a sum of positive length differences), so finer buckets multiply the graphs, the
# more so under DDP, where a graph is keyed by every rank's counts (32nds gave 3-4 counts a layer at 32x128).
LENT_BUCKETS = 16


def lent_bucket(n_lent: int, total: int) -> int:
    """`n_lent` lent rows rounded up to a multiple of ``ceil(total / LENT_BUCKETS)`` (0 stays 0): `lent`'s static
    count."""
    if n_lent <= 0:
        return 0
    step = math.ceil(total / LENT_BUCKETS)
    return min(total, math.ceil(n_lent / step) * step)


def lent(rows: torch.Tensor | None):
    """Within: the packed layers up to the narrowing carry the rows `rows` marks ([B, T] boolean: padding rows only)
    forward without autograd (module docstring), and `lent_rows` hands them over; None, or no row marked: nothing.
    Under a `static_rows` triple, its third number of rows (at least those marked: asserted on the device); else
    the marked rows (one host synchronisation)."""
    _check_rows("rows", rows, "lent")
    if rows is None or rows is KEYS:
        return _scoped(_lent, "state", None)
    flat = rows.reshape(-1)
    n = static_count()
    if isinstance(n, tuple) and len(n) == 3:
        n, count = n[2], flat.sum()
        torch._assert_async(count <= n)
        if n == 0:
            return _scoped(_lent, "state", None)
        idx = torch.sort((~flat).to(torch.uint8), stable=True).indices[:n]
        used = torch.arange(n, device=flat.device) < count
        dest = torch.where(used, idx, flat.numel())
    else:
        idx = flat.nonzero().squeeze(1)
        if idx.numel() == 0:
            return _scoped(_lent, "state", None)
        dest = idx
    return _joined(_Lent(rows, idx, dest))


@contextlib.contextmanager
def _joined(state):
    """`_scoped` for `lent`'s state, which ends with the current stream waiting for the lent rows' lane."""
    try:
        with _scoped(_lent, "state", state):
            yield
    finally:
        state.join()


def lent_state():
    """`lent`'s state in force (`_Lent`), or None."""
    return getattr(_lent, "state", None)


def lent_rows():
    """``(dest, rows)``: the lent rows' hidden states as the packed layers left them and where each goes
    (`with_lent`), or None where no layer carried them (none packed: the padded path computed them in place). Marks
    them handed over: later layers do not carry them. A forward in which a layer could not carry them raises."""
    state = lent_state()
    if state is None or state.done:
        return None
    state.done = True
    if state.broken:
        raise RuntimeError("packing.lent: a layer up to the narrowing did not run packed, so the lent padding rows "
                           "were not carried through it (run with packing.LENT = False)")
    if state.x is None:
        return None
    state.join()  # made on the lane: read here once it has made them
    return state.dest, state.x


def with_lent(hidden: torch.Tensor, dest: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A copy of `hidden` [B, T, D] with the rows of `lent_rows` written in (their dtype cast to hidden's); rows
    bound for the scratch row B·T go nowhere."""
    B, T, D = hidden.shape
    out = hidden.new_empty(B * T + 1, D)
    out[:B * T].copy_(hidden.detach().reshape(B * T, D))
    copy_rows_(out, dest, rows.to(hidden.dtype))
    return out[:B * T].view(B, T, D)


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


class Plan:
    """The packed layout of a [B, T] batch: `idx`, the N rows of ``hidden.reshape(B * T, D)`` packed (the rows
    `rows` marks ascending, then, with a static row count, padding rows), `real`, the [B, T] real-token mask (the
    keys), `rows`, the [B, T] rows packed (`real` itself, or `extended`'s rows), and `static`, `static_rows`'s n or
    None. Made once per mask (`real_rows`'s memo), shared by the layers of a forward."""

    __slots__ = ("idx", "B", "T", "real", "rows", "static", "_offsets", "_sources", "_first")

    def __init__(self, idx, B, T, real, static, rows=None):
        self.idx, self.B, self.T, self.real, self.static, self._offsets = idx, B, T, real, static, None
        self._sources = self._first = None
        self.rows = real if rows is None else rows

    def offsets(self):
        """``(cu, max_len)`` for variable-length attention over the packed rows: int32 offsets of each sequence's
        rows (the packed rows of each of the B sequences; a static count's extra padding rows then as sequences of
        at most T rows of their own, which attend among themselves and nobody reads) and the longest, T. On the
        device, without a host synchronisation."""
        return self.attention_layout()[:2]

    def attention_layout(self):
        """``(cu_q, max_len, cu_k, key_rows)``: `offsets`, the offsets of the keys and the packed rows the keys
        are, in order (int64, a permutation of the N rows, the keys first; rows past ``cu_k[-1]`` are no key), or
        ``cu_k = cu_q`` and None where every packed row is a key (no `extended` rows)."""
        if self._offsets is None:
            counts = self.rows.sum(1, dtype=torch.int32)
            cu_q = self._cumulative(counts)
            if self.rows is self.real:
                self._offsets = (cu_q, self.T, cu_q, None)
            else:
                extra = None if self.static is None else self.static - cu_q[self.B:self.B + 1]
                cu_k = self._cumulative(self.real.sum(1, dtype=torch.int32), extra)
                key = self.real.reshape(-1).index_select(0, self.idx)
                packed = self.rows.reshape(-1).index_select(0, self.idx)
                # 0: a key; 1: a static count's extra row (a key of its own sequence); 2: a packed padding row
                order = torch.where(key, 0, torch.where(packed, 2, 1)).to(torch.uint8)
                self._offsets = (cu_q, self.T, cu_k, torch.sort(order, stable=True).indices)
        return self._offsets

    def first_row_keys(self):
        """``((seq, key_rows, positions, T), starts)`` for attention of each sequence's row 0 over its keys
        (`layers.attention.first_row_packed`): the int32 offsets of the B sequences' keys (B + 1) among the packed
        rows, or where `extended` rows are packed among the gathered keys (`attention_layout`'s key order, then
        `key_rows`), each packed row's index in the padded [B·T] layout (`idx`), T, and the packed row of each
        sequence's first token (int64 [B]). On the device."""
        if self._first is None:
            cu_q, T, cu_k, key_rows = self.attention_layout()
            B = self.B
            self._first = (cu_k[:B + 1], key_rows, self.idx, T), cu_q[:B].long()
        return self._first

    def key_sources(self):
        """Where each packed row's key is among `attention_layout`'s gathered keys (int64 [N]: the inverse of its
        key order), -1 for a row that is no key; None where every packed row is a key. A gathered key's gradient
        goes back to its row by it (`kernels.triton.column_sums.concat`'s `gather`). On the device."""
        if self._sources is None:
            _, _, cu_k, keys = self.attention_layout()
            if keys is None:
                return None
            where = torch.empty_like(keys).scatter_(0, keys, torch.arange(keys.numel(), device=keys.device))
            self._sources = torch.where(where < cu_k[-1], where, -1)
        return self._sources

    def _cumulative(self, counts, extra=None):
        """int32 offsets of `counts` ([B]), then, with a static count, its extra rows (`extra`, a [1] tensor; by
        default what the counts leave of it) in sequences of at most T."""
        cu = [counts.new_zeros(1), counts.cumsum(0, dtype=torch.int32)]
        if self.static is not None:
            total = cu[1][-1:]
            extra = self.static - total if extra is None else extra
            k = torch.arange(1, -(-self.static // self.T) + 1, device=counts.device, dtype=torch.int32)
            cu.append(total + torch.minimum(k * self.T, extra))
        return torch.cat(cu)


def real_rows(mask: torch.Tensor | None, B: int, T: int, min_padding: float) -> torch.Tensor | None:
    """Indices (int64, ascending) of the real rows of ``hidden.reshape(B * T, D)`` that `mask` marks, or None: no
    mask, a mask of another form, no real row, or padding on fewer than `min_padding` of the B·T rows."""
    found = plan(mask, B, T, min_padding)
    return None if found is None else found.idx


def plan(mask: torch.Tensor | None, B: int, T: int, min_padding: float) -> Plan | None:
    """The packed layout (`Plan`) of the real rows `real_rows` finds (within `extended`, of its rows, which must
    hold them), or None where it finds none."""
    if mask is None:
        return None
    state = getattr(_extend, "state", None)
    n_before, n_after = _static_counts()
    n = n_after if state is not None and state.narrowed else n_before
    rows = None if state is None else state.current()
    if rows is not None and tuple(rows.shape) != (B, T):
        rows = None
    entry = getattr(_last, "entry", None)
    key = (B, T, min_padding, n, None if rows is None else rows._version)
    if (entry is not None and entry[0]() is mask and entry[1] == mask._version and entry[2] == key
            and (entry[4] is None if rows is None else entry[4] is not None and entry[4]() is rows)):
        return entry[3]
    found = _real_keys(mask, B, T)
    idx = None
    if found is not None:
        real, ok = found
        checks = [] if ok is None else [ok]
        pick = real if rows is None else rows.to(real.device)
        if rows is not None:
            checks.append((real <= pick).all())  # the rows packed hold every key
        checks.append(real[:, 0].all())
        ok = torch.stack(checks).all()
        if n is not None:
            if n < B * T:
                idx = _static_real_rows(pick, ok, n)
        elif bool(ok):
            idx = pick.reshape(-1).nonzero().squeeze(1)
            if idx.numel() == 0 or idx.numel() > (1.0 - min_padding) * B * T:
                idx = None
    result = None if idx is None else Plan(idx, B, T, found[0], n, None if rows is None else pick)
    _last.entry = (weakref.ref(mask), mask._version, key, result, None if rows is None else weakref.ref(rows))
    return result


def _static_real_rows(rows: torch.Tensor, ok: torch.Tensor, n: int) -> torch.Tensor:
    """`n` row indices, the rows of the [B, T] mask `rows` first (ascending), then the others (ascending); on the
    device, asserting there that `rows` number at most `n` and `ok` (`plan`'s checks: a key-padding mask, a real
    first position, the rows holding every key)."""
    flat = rows.reshape(-1)
    torch._assert_async(ok)
    torch._assert_async(flat.sum() <= n)
    return torch.sort((~flat).to(torch.uint8), stable=True).indices[:n]


def attend(qkv_leaf, shape, attn_mask, p, scale, packed):
    """``(graph output, its rows)`` of the attention over the projections `qkv_leaf` (rows of ``[q | k | v]``, a
    leaf that requires grad) under `attn_mask` (SDPA's mask, or a callable that makes it: the variable-length path
    reads the plan's offsets instead and never makes it): the padded layout's ``[B, heads, T, width]`` context and
    its detached ``[B·T, heads·width]`` rows when `packed` (a `Plan`) is None; else `qkv_leaf` holds the plan's N
    rows only and both are the context's N rows ``[N, heads·width]``: by variable-length attention where it
    applies (`varlen_applies`), else in the padded layout with zero projections on the other rows (masked keys;
    padding queries nobody reads)."""
    B, T, heads, width = shape
    with torch.enable_grad():
        if packed is not None and varlen_applies(qkv_leaf, width):
            cu, max_len, cu_k, keys = packed.attention_layout()
            rows = _VarlenAttention.apply(qkv_leaf, cu, max_len, heads, width, p, scale, cu_k, keys,
                                          None if keys is None else packed.key_sources())
            return rows, rows.detach()
        full = qkv_leaf
        if callable(attn_mask):
            attn_mask = attn_mask()
        if packed is not None:
            full = qkv_leaf.new_zeros(B * T, qkv_leaf.shape[1]).index_copy(0, packed.idx, qkv_leaf)
        q, k, v = (t.view(B, T, heads, width).transpose(1, 2) for t in full.split(heads * width, dim=1))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p, scale=scale)
        if packed is None:
            return context, context.detach().transpose(1, 2).reshape(-1, heads * width)
        rows = context.transpose(1, 2).reshape(B * T, heads * width).index_select(0, packed.idx)
    return rows, rows.detach()


def varlen_applies(qkv: torch.Tensor, width: int) -> bool:
    """Whether packed rows attend by variable-length attention (`varlen_forward`): `VARLEN`, CUDA, 16-bit
    projections, a head width flash attention takes, flash attention enabled (`torch.backends.cuda`; where
    `VARLEN_KERNEL` is "triton", cat_fast's own kernels attend where they take the head width, flash attention
    elsewhere)."""
    return (VARLEN and qkv.is_cuda and qkv.dtype in (torch.bfloat16, torch.float16) and width % 8 == 0
            and width <= 256 and torch.backends.cuda.flash_sdp_enabled()
            and hasattr(torch.ops.aten, "_flash_attention_forward")
            and torch.cuda.get_device_capability(qkv.device) >= (8, 0))


def _own_varlen(q: torch.Tensor, p: float, max_len: int = 0):
    """`kernels.triton.varlen_attention` where `VARLEN_KERNEL` asks for it and it takes `q` [N, H, D], `p` and
    sequences of up to `max_len` rows, else None (PyTorch's flash attention)."""
    if VARLEN_KERNEL not in ("triton", "flash"):
        raise ValueError(f"cat_fast.layers.packing.VARLEN_KERNEL: expected 'triton' or 'flash', got {VARLEN_KERNEL!r}")
    if VARLEN_KERNEL != "triton":
        return None
    kernels = fused_kernels("varlen_attention")
    return kernels if kernels is not None and kernels.supports(q, p, max_len) else None


def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, p, scale, covered: bool = True):
    """``(out [Nq, H, D], saved)``: variable-length attention of `q` over `k`, `v` ([N, H, D] views), each sequence
    its `cu_q` queries and `cu_k` keys, by `VARLEN_KERNEL`'s kernels; `saved`, what `varlen_backward` takes (the
    log-sum-exps and the dropout's bits or Philox state, and which kernels ran). `covered`: every query row lies in
    a sequence (else cat_fast's kernels write 0 to the others; flash attention leaves them unwritten)."""
    own = _own_varlen(q, p, max(int(max_q), int(max_k)))
    if own is not None:
        key = own.draw_key(q.device) if p else None
        out, lse, bits = own.forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, p, key, covered=covered)
        return out, (own, lse, bits, None)
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, p, False, False, scale=scale)
    return out, (None, lse, rng, unused)


def varlen_backward(grad, q, k, v, out, saved, cu_q, cu_k, max_q, max_k, p, scale):
    """``(dq, dk, dv)`` [N, H, D] of `varlen_forward`'s output given its gradient `grad` [N, H, D] (every query and
    key row in a sequence, as the packed layers' are)."""
    own, lse, rng, unused = saved
    if own is not None:
        return own.backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, p, rng, covered=True)
    return torch.ops.aten._flash_attention_backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, p, False, rng,
                                                    unused, scale=scale)


class _VarlenAttention(torch.autograd.Function):
    """Attention over packed rows of ``[q | k | v]`` [N, 3·heads·width], each sequence its `cu` span, by
    variable-length attention (`varlen_forward`; forward and backward, with their own dropout draws). `keys` (a
    permutation of the rows, `Plan.attention_layout`): the key and value rows are gathered in that order (one
    gather of both), each sequence its `cu_k` span of them; their gradients go back to the rows' order by `sources`
    (`Plan.key_sources`) as dq, dk and dv are joined."""

    @staticmethod
    def forward(ctx, qkv, cu, max_len, heads, width, p, scale, cu_k=None, keys=None, sources=None):
        D = heads * width
        q, k, v = (qkv[:, i * D:(i + 1) * D].view(-1, heads, width) for i in range(3))
        if keys is not None:
            kv = qkv[:, D:].index_select(0, keys)
            k, v = kv[:, :D].view(-1, heads, width), kv[:, D:].view(-1, heads, width)
        else:
            cu_k = cu
        out, saved = varlen_forward(q, k, v, cu, cu_k, max_len, max_len, p, scale)
        own, lse, rng, unused = saved
        ctx.save_for_backward(qkv, cu, cu_k, keys, sources, k, v, out, lse, rng, unused)
        ctx.own = own
        ctx.args = (max_len, heads, width, p, scale)
        return out.view(-1, D)

    @staticmethod
    def backward(ctx, grad):
        qkv, cu, cu_k, keys, sources, k, v, out, lse, rng, unused = ctx.saved_tensors
        max_len, heads, width, p, scale = ctx.args
        D = heads * width
        q = qkv[:, :D].view(-1, heads, width)
        if keys is None:
            k, v = (qkv[:, i * D:(i + 1) * D].view(-1, heads, width) for i in (1, 2))
        dq, dk, dv = varlen_backward(grad.contiguous().view(-1, heads, width), q, k, v, out,
                                     (ctx.own, lse, rng, unused), cu, cu_k, max_len, max_len, p, scale)
        sum_columns = getattr(ctx, "sum_columns", False)
        kernels = fused_kernels("column_sums") if sum_columns or keys is not None else None
        if keys is not None and kernels is None:  # back to the rows' order; past the last key no key: zero
            used = (torch.arange(dk.shape[0], device=dk.device) < cu_k[-1]).view(-1, 1, 1)
            dk, dv = (torch.empty_like(t).index_copy_(0, keys, torch.where(used, t, 0)) for t in (dk, dv))
        parts = [t.reshape(-1, D) for t in (dq, dk, dv)]
        if kernels is not None:  # one pass: the key rows put back in order, the bias gradient summed if asked
            grad_qkv, sums = kernels.concat(parts, want_sums=sum_columns, gather=sources)
            if sum_columns:  # `attention_backward`
                ctx.column_sums = sums
        else:
            grad_qkv = torch.cat(parts, 1)
        return grad_qkv, None, None, None, None, None, None, None, None, None


def attention_backward(out, qkv_leaf, grad_rows, shape, packed: bool, column_sums: bool = False):
    """``(the gradient w.r.t. `qkv_leaf` of `attend`'s graph output `out`, given the gradient of its rows, its
    column sums in fp32 or None)``. `column_sums`: where variable-length attention ran (CUDA, Triton), the column
    sums (the projections' bias gradient) are summed while its dq, dk and dv are joined (`kernels.triton.column_sums
    .concat`); elsewhere, and without `column_sums`, the second is None."""
    B, T, heads, width = shape
    grad = grad_rows if packed else grad_rows.view(B, T, heads, width).transpose(1, 2)
    node = out.grad_fn if column_sums and packed else None
    if node is not None and type(node) is not _VarlenAttention._backward_cls:
        node = None
    if node is not None:
        node.sum_columns, node.column_sums = True, None
    try:
        # retained: this one-node graph is freed with the saved tensors (a retain_graph backward can run again)
        (grad_qkv,) = torch.autograd.grad(out, qkv_leaf, grad, retain_graph=True)
    finally:
        if node is not None:
            node.sum_columns = False
    sums = None
    if node is not None:
        sums, node.column_sums = node.column_sums, None
    return grad_qkv, sums


def _wide(t: torch.Tensor) -> torch.Tensor | None:
    """`t` [M, D] viewed as rows of 16-byte elements (complex128) where its layout allows it (contiguous rows of a
    multiple of 16 bytes, 16-byte aligned), else None. PyTorch's index_copy and index_fill compute an index per
    element: per 16 bytes, 4 (fp32) to 8 (16-bit) times fewer, for the same bytes moved."""
    if (t.dim() != 2 or not t.is_contiguous() or (t.shape[1] * t.element_size()) % 16
            or t.data_ptr() % 16 or t.is_complex()):
        return None
    return t.view(torch.complex128)


def copy_rows_(out: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out.index_copy_(0, idx, rows)`` ([M, D] and [N, D] of one dtype) by 16-byte elements where both allow it
    (`_wide`); returns `out`."""
    wide_out, wide_rows = _wide(out), _wide(rows)
    if wide_out is not None and wide_rows is not None and rows.dtype == out.dtype:
        wide_out.index_copy_(0, idx, wide_rows)
        return out
    return out.index_copy_(0, idx, rows)


def zero_rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """A copy of `t` [M, D] with its `idx` rows zero (``t.index_fill(0, idx, 0)``, by 16-byte elements where the
    layout allows it: `_wide`)."""
    out = t.clone(memory_format=torch.contiguous_format)
    wide = _wide(out)
    (wide if wide is not None else out).index_fill_(0, idx, 0)
    return out


def scatter(full: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A copy of `full` [B·T, D] in `rows`' dtype with its `idx` rows replaced by `rows` [N, D]."""
    out = full.to(rows.dtype, memory_format=torch.contiguous_format, copy=True)
    return copy_rows_(out, idx, rows.contiguous())


class _Pack(torch.autograd.Function):
    """The `idx` rows of ``hidden.reshape(-1, D)``; its gradient is zero on the other rows, but where the unpacks
    of the rows it starts (`unpack` with this node as `link`) leave theirs in ``ctx.unpacked``: their gradient of
    `hidden` (the output's on every row), whose `idx` rows this backward overwrites with its own."""

    @staticmethod
    def forward(ctx, hidden, idx):
        ctx.save_for_backward(idx)
        ctx.shape, ctx.unpacked = hidden.shape, None
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, idx)

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        full, ctx.unpacked = ctx.unpacked, None
        if full is None:
            full = grad.new_zeros(ctx.shape[:-1].numel(), grad.shape[-1])
        return copy_rows_(full, idx, grad.to(full.dtype).contiguous()).view(ctx.shape), None


class _Unpack(torch.autograd.Function):
    """`full` [B, T, D] with its `idx` rows replaced by `rows` [N, D] (in rows' dtype). `link`: the `_Pack` node
    of `full` from which `rows` descend, or None. With a link, `full` is passed detached and its gradient (the
    output's, on every row) is left to the link (`_Pack`), which overwrites the `idx` rows: one copy of the full
    gradient, where zeroing the rows here and adding the pack's gradient there took four."""

    @staticmethod
    def forward(ctx, rows, full, idx, link):
        ctx.save_for_backward(idx)
        ctx.dtype, ctx.link = full.dtype, link
        return scatter(full.reshape(-1, full.shape[-1]), idx, rows).view(full.shape)

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        link, grad_full = ctx.link, None
        if link is not None and will_run(link):
            if link.unpacked is None:
                link.unpacked = flat.to(dtype=ctx.dtype, memory_format=torch.contiguous_format, copy=True)
            else:
                link.unpacked.add_(flat.to(ctx.dtype))
        elif ctx.needs_input_grad[1]:
            grad_full = zero_rows(flat, idx).view(grad.shape).to(ctx.dtype)
        return flat.index_select(0, idx), grad_full, None, None


def pack(hidden: torch.Tensor, packed: Plan) -> torch.Tensor:
    """The plan's rows of `hidden` [B, T, D] as [1, N, D] (differentiable: zero gradient on the other rows).
    `link(rows)` is then the node to hand `unpack` (and `carry`) for the rows that descend from these."""
    rows = _Pack.apply(hidden, packed.idx)
    out = rows.unsqueeze(0)
    out._cat_fast_link = rows.grad_fn
    return out


def link(rows: torch.Tensor):
    """The `_Pack` node of `pack`'s output `rows`, or None (no gradient recorded)."""
    return getattr(rows, "_cat_fast_link", None)


def unpack(rows: torch.Tensor, packed: Plan, full: torch.Tensor, link=None) -> torch.Tensor:
    """[B, T, D]: `full`'s rows with the plan's rows replaced by `rows` ([1, N, D] or [N, D]); differentiable in
    both (`full`'s gradient is the output's on the other rows). `link`: the node `link` gave for the `pack` of
    `full` from which `rows` descend (`full`'s gradient is then handed to it, `_Unpack`), or None."""
    if link is not None and not (full.requires_grad and torch.is_grad_enabled()):
        link = None
    return _Unpack.apply(rows.reshape(-1, rows.shape[-1]), full.detach() if link is not None else full,
                         packed.idx, link)


def carrying(layers):
    """Within: the outputs of the layer modules in `layers` (a collection, or None: none) may stay packed for the
    next layer (`carry`), which reads them packed (`carried`); `fast_layers.training_layers` sets it for a forward
    whose consecutive encoder layers are all training layers and nothing else reads their outputs."""
    return _scoped(_carry, "layers", layers)


def may_carry(layer) -> bool:
    """Whether `layer`'s output may stay packed (`carrying`)."""
    layers = getattr(_carry, "layers", None)
    return layers is not None and layer in layers


def carry(rows: torch.Tensor, packed: Plan, full: torch.Tensor, link=None) -> torch.Tensor:
    """`rows` [1, N, D], marked as the packed form of a [B, T, D] tensor whose other rows are `full`'s (`carried`,
    `unpack`; `link`: the node of the `pack` of `full` from which `rows` descend, or None). Returns `rows`."""
    rows._cat_fast_packed = (packed, full, rows._version, link)
    return rows


def carried(x) -> tuple[Plan, torch.Tensor, object] | None:
    """``(plan, full, link)`` when `x` is a layer output `carry` marked (and unchanged since), else None:
    ``unpack(x, *carried(x))`` is its unpacked form."""
    found = getattr(x, "_cat_fast_packed", None)
    if found is None or found[2] != x._version:
        return None
    return found[0], found[1], found[3]
