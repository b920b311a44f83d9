"""Attention over packed rows, each sequence its own span of queries and of keys (cumulative offsets, as PyTorch's
variable-length flash attention takes them), forward and backward, with the attention dropout (a mask of bits a
first kernel writes): what the padding-free layers run on CUDA (`cat_fast.layers.packing`).

Layout: ``q`` [Nq, H, D] and ``k``, ``v`` [Nk, H, D], any row stride (views of a joined ``[q | k | v]`` projection
work as they are), unit stride along D and stride D along H, D a power of two; sequence b's queries are rows
``cu_q[b]:cu_q[b + 1]``, its keys ``cu_k[b]:cu_k[b + 1]``; within a sequence the kernels address rows by 32-bit
offsets from its first row (its rows times the row stride below 2³¹: `supports`). With ``S = scale·QKᵀ``,
``P = softmax(S)`` over the sequence's keys, ``Z = keep / (1 − p')``: ``O = (P∘Z) V``; the backward, with
``Δ = rowsum(dO∘O)``: ``dV = (P∘Z)ᵀ dO``, ``dP = Z∘(dO Vᵀ)``, ``dS = P∘(dP − Δ)``, ``dQ = scale·dS K``,
``dK = scale·dSᵀ Q``. A query of a sequence without keys gets 0 (and no gradient).

The dropout: ``keep`` is a function of a 64-bit key (`draw_key`: one number drawn from the device's PyTorch
generator, so a CUDA graph redraws it at each replay and a generator set back to a state redraws the same masks)
and of the element's place. A first kernel writes the mask as bits, one 32-bit word per 32 keys of a query row of a
head (``bits`` [H, Nq, ⌈max_k / 32⌉], int32): word w of row r (its index among all Nq) of head h takes the 32 bytes of
two Philox-4x32-10 draws keyed by the key, counters (0, 0, 2·(r·⌈max_k / 32⌉ + w) + i, h) for i = 0, 1; bit b is
byte ``b % 4`` (the low one first) of draw ``b // 16``'s word ``(b // 4) % 4``, and the key ``32 w + b`` of the
sequence is kept when that byte is at least ``t = round(p · 256)``. The drop rate is p rounded to a multiple of
1/256 (p' = t / 256; 0.1 reads 0.1016, the rate PyTorch's flash attention applies for 0.1 too) and the kept
probabilities are scaled by 1 / (1 − p'), so that the expectation is exactly P V. The forward and both backward
kernels read the bits (4.7 MB a layer at the step suite's 64×256 batch): drawn inside the attention kernels and
arranged as a score tile, the numbers cost more than the tile's products (`benchmarks/RESULTS.md`).
`keep_mask` decodes them (tests, references).
"""
import torch
import triton
import triton.language as tl

from ._common import acc_tl_dtype, scalar_acc, split_scalar, tile_dot

__all__ = ["forward", "backward", "keep_mask", "keep_bits", "draw_key", "drop_rate", "supports", "TILES"]

# (rows, keys, warps, stages) per kernel for 16-bit inputs, from benchmarks/tools/varlen_attention.py on an H200 at
# the step suite's batches; fp32 takes tiles of 32 (or fewer) rows and 32 keys, float64 16 rows and 32 keys (shared
# memory); keys' tiles are whole words of the dropout's bits
TILES = {"forward": (64, 64, 4, 3), "dkdv": (32, 64, 4, 2), "dq": (64, 64, 4, 3)}
_LEVELS = 256  # the dropout's numbers are bytes
_OFFSETS = 1 << 31  # the kernels address a sequence's rows by 32-bit offsets from its first row


def _threshold(p: float) -> int:
    """t: a byte at least t keeps its element (module docstring)."""
    return round(float(p) * _LEVELS)


def drop_rate(p: float) -> float:
    """The drop rate the kernels apply for a requested `p`: p rounded to a multiple of 1/256."""
    return _threshold(p) / _LEVELS


def supports(q: torch.Tensor, p: float = 0.0, max_len: int = 0) -> bool:
    """Whether these kernels take `q` [N, H, D] (CUDA or the Triton interpreter; a head width that is a power of two
    from 16 to 256; 16-bit, fp32 or float64) and the dropout `p`: 0, or a p whose rate p' (`drop_rate`) is neither 0
    nor 1; and sequences of up to `max_len` rows (offsets within a sequence are 32-bit: `max_len` times the row stride,
    at least a joined [q | k | v]'s 3·H·D, below 2³¹)."""
    D = q.shape[-1]
    return (q.dim() == 3 and q.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
            and 16 <= D <= 256 and D & (D - 1) == 0 and (p == 0 or 0.0 < drop_rate(p) < 1.0)
            and max_len * max(q.stride(0), 3 * q.shape[1] * D) < _OFFSETS)


def draw_key(device, generator=None) -> torch.Tensor:
    """A dropout key: an int64 [1] drawn on `device` from `generator` (the device's default)."""
    return torch.empty(1, dtype=torch.int64, device=device).random_(generator=generator)


def _tiles(kind, dtype):
    BM, BN, W, S = TILES[kind]
    if dtype == torch.float32:
        BM, BN = min(BM, 32), 32
    elif dtype == torch.float64:  # keys' tiles are whole words of the dropout's bits: 32
        BM, BN, W, S = 16, 32, 4, 1
    if BN % 32 or BM % 16:
        raise ValueError(f"varlen attention: TILES[{kind!r}] = {TILES[kind]}: keys' tiles must be multiples of 32 "
                         "(words of the dropout's bits) and rows' of 16")
    return BM, BN, W, S


@triton.jit
def _bits4(r, threshold):
    """4 bits: which of the bytes of the words `r` are at least `threshold` (the low byte, bit 0)."""
    return (((r & 255) >= threshold).to(tl.uint32) | ((((r >> 8) & 255) >= threshold).to(tl.uint32) << 1)
            | ((((r >> 16) & 255) >= threshold).to(tl.uint32) << 2) | (((r >> 24) >= threshold).to(tl.uint32) << 3))


@triton.jit
def _keep_words(BITS, KEY, Nq, words, threshold, BR: tl.constexpr, BW: tl.constexpr):
    """The dropout's bits of BR query rows of head program_id(1) (module docstring)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    h = tl.program_id(1)
    w = tl.arange(0, BW)
    c = (r.to(tl.uint32)[:, None] * words + w.to(tl.uint32)[None, :]) * 2
    z = c * 0
    hh = z + h.to(tl.uint32)
    key = tl.load(KEY)
    r0, r1, r2, r3 = tl.philox(key, z, z, c, hh, 10)
    r4, r5, r6, r7 = tl.philox(key, z, z, c + 1, hh, 10)
    bits = (_bits4(r0, threshold) | (_bits4(r1, threshold) << 4) | (_bits4(r2, threshold) << 8)
            | (_bits4(r3, threshold) << 12) | (_bits4(r4, threshold) << 16) | (_bits4(r5, threshold) << 20)
            | (_bits4(r6, threshold) << 24) | (_bits4(r7, threshold) << 28))
    tl.store(BITS + (h.to(tl.int64) * Nq + r.to(tl.int64)[:, None]) * words + w[None, :],
             bits.to(tl.int32, bitcast=True),
             mask=(r < Nq)[:, None] & (w < words)[None, :])


@triton.jit
def _kept(BITS, i, im, n0, words, BM: tl.constexpr, BN: tl.constexpr):
    """[BM, BN] bool: which scores of query rows `i` of the sequence (`BITS` at its first row's words) and keys
    n0..n0+BN are kept (n0 a multiple of 32)."""
    w = tl.load(BITS + i[:, None] * words + n0 // 32 + tl.arange(0, BN // 32)[None, :], mask=im[:, None], other=0)
    bits = (w[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1
    return tl.reshape(bits, [BM, BN]) != 0


@triton.jit
def _kept_by_keys(BITS, i, im, n0, words, BM: tl.constexpr, BN: tl.constexpr):
    """`_kept`'s tile transposed: [BN, BM], keys by queries."""
    w = tl.load(BITS + i[None, :] * words + n0 // 32 + tl.arange(0, BN // 32)[:, None], mask=im[None, :], other=0)
    bits = (w[:, None, :] >> tl.arange(0, 32)[None, :, None]) & 1
    return tl.reshape(bits, [BN, BM]) != 0


@triton.jit
def _scale_of(hi, lo, EXP2: tl.constexpr, ACC: tl.constexpr):
    """The scores' factor: the scale, times log2(e) where the softmax is taken in base 2 (`_exp`)."""
    scale = scalar_acc(hi, lo, ACC)
    if EXP2:
        scale = scale * 1.4426950408889634
    return scale


@triton.jit
def _exp(x, EXP2: tl.constexpr):
    if EXP2:
        return tl.math.exp2(x)
    return tl.exp(x)


@triton.jit
def _inv_keep(threshold, ACC: tl.constexpr):
    """1 / (1 − p') in the accumulation dtype, from the threshold t (p' = t / 256)."""
    return 256.0 / (256 - threshold).to(ACC)


@triton.jit
def _program(cu_q, cu_k):
    """(tile, head, first query row, query count, first key row, key count) of this program: its tile
    program_id(0) of sequence program_id(1), head program_id(2); the first rows int64."""
    b = tl.program_id(1)
    q0 = tl.load(cu_q + b)
    k0 = tl.load(cu_k + b)
    Lq = tl.load(cu_q + b + 1) - q0
    Lk = tl.load(cu_k + b + 1) - k0
    return tl.program_id(0), tl.program_id(2), q0.to(tl.int64), Lq, k0.to(tl.int64), Lk


@triton.jit
def _rows_of(X, s_x, i, im, D: tl.constexpr):
    """The [len(i), D] tile of rows `i` of X (a pointer at the sequence's first row and the head's first column; `i`
    and the offsets int32) (0 outside `im`)."""
    return tl.load(X + i[:, None] * s_x + tl.arange(0, D)[None, :], mask=im[:, None], other=0.0)


@triton.jit
def _cols_of(X, s_x, j, jm, D: tl.constexpr):
    """`_rows_of` transposed: the [D, len(j)] tile of rows `j` of X."""
    return tl.load(X + j[None, :] * s_x + tl.arange(0, D)[:, None], mask=jm[None, :], other=0.0)


@triton.jit
def _store_rows(X, s_x, i, im, x, D: tl.constexpr):
    """Write `x` [len(i), D] (cast to X's dtype) as rows `i` of X (as `_rows_of`)."""
    tl.store(X + i[:, None] * s_x + tl.arange(0, D)[None, :], x.to(X.dtype.element_ty), mask=im[:, None])


@triton.jit
def _key_scores(q, K, s_k, Lk, n0, scale, D: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr,
                IEEE: tl.constexpr, ACC: tl.constexpr):
    """(key mask, key offsets, Kᵀ [D, BN], the scaled scores [BM, BN]) of query tile `q` and keys n0..n0+BN (`K` at
    the sequence's first key row and the head)."""
    j = n0 + tl.arange(0, BN)
    jm = j < Lk
    kT = _cols_of(K, s_k, j, jm, D)
    return jm, j, kT, tile_dot(q, kT, DT, IEEE).to(ACC) * scale


@triton.jit
def _forward(Q, K, V, O, LSE, BITS, cu_q, cu_k, s_q, s_k, s_v, s_o, Nq, words, scale_hi, scale_lo, threshold,
             D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DROP: tl.constexpr, DT: tl.constexpr,
             IEEE: tl.constexpr, EXP2: tl.constexpr, ACC: tl.constexpr):
    pid, h, q0, Lq, k0, Lk = _program(cu_q, cu_k)
    if pid * BM >= Lq:
        return
    scale = _scale_of(scale_hi, scale_lo, EXP2, ACC)
    i = pid * BM + tl.arange(0, BM)
    im = i < Lq
    hd = h * D
    q = _rows_of(Q + q0 * s_q + hd, s_q, i, im, D)
    K = K + k0 * s_k + hd
    V = V + k0 * s_v + hd
    BITS = BITS + (h.to(tl.int64) * Nq + q0) * words
    m_i = tl.full([BM], float("-inf"), ACC)
    l_i = tl.zeros([BM], ACC)
    acc = tl.zeros([BM, D], ACC)
    for n0 in range(0, Lk, BN):
        jm, j, _, s = _key_scores(q, K, s_k, Lk, n0, scale, D, BN, DT, IEEE, ACC)
        s = tl.where(jm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        pe = _exp(s - m_new[:, None], EXP2)
        alpha = _exp(m_i - m_new, EXP2)
        l_i = l_i * alpha + tl.sum(pe, 1)
        if DROP:
            pe = tl.where(_kept(BITS, i, im, n0, words, BM, BN), pe, 0.0)
        v = _rows_of(V, s_v, j, jm, D)
        acc = acc * alpha[:, None] + tile_dot(pe.to(DT), v, DT, IEEE).to(ACC)
        m_i = m_new
    seen = l_i > 0
    inv = 1.0 / tl.where(seen, l_i, 1.0)
    if DROP:
        inv = inv * _inv_keep(threshold, ACC)
    inv = tl.where(seen, inv, 0.0)
    _store_rows(O + q0 * s_o + hd, s_o, i, im, acc * inv[:, None], D)
    if EXP2:
        lse = m_i + tl.math.log2(tl.where(seen, l_i, 1.0))
    else:
        lse = m_i + tl.log(tl.where(seen, l_i, 1.0))
    tl.store(LSE + h.to(tl.int64) * Nq + q0 + i, tl.where(seen, lse, float("inf")), mask=im)


@triton.jit
def _delta(O, DO, DELTA, s_o, s_do, Nq, D: tl.constexpr, BR: tl.constexpr, ACC: tl.constexpr):
    r0 = tl.program_id(0).to(tl.int64) * BR
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    h = tl.program_id(1)
    m = r < Nq
    i = tl.arange(0, BR)
    o = _rows_of(O + r0 * s_o + h * D, s_o, i, m, D).to(ACC)
    do = _rows_of(DO + r0 * s_do + h * D, s_do, i, m, D).to(ACC)
    tl.store(DELTA + h.to(tl.int64) * Nq + r, tl.sum(o * do, 1), mask=m)


@triton.jit
def _dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, BITS, cu_q, cu_k, s_q, s_k, s_v, s_do, s_dk, s_dv, Nq, words, scale_hi,
          scale_lo, threshold, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DROP: tl.constexpr,
          DT: tl.constexpr, IEEE: tl.constexpr, EXP2: tl.constexpr, ACC: tl.constexpr):
    pid, h, q0, Lq, k0, Lk = _program(cu_q, cu_k)
    if pid * BN >= Lk:
        return
    scale = _scale_of(scale_hi, scale_lo, EXP2, ACC)
    j = pid * BN + tl.arange(0, BN)
    jm = j < Lk
    hd = h * D
    k = _rows_of(K + k0 * s_k + hd, s_k, j, jm, D)
    v = _rows_of(V + k0 * s_v + hd, s_v, j, jm, D)
    Q = Q + q0 * s_q + hd
    DO = DO + q0 * s_do + hd
    hq = h.to(tl.int64) * Nq + q0
    LSE = LSE + hq
    DELTA = DELTA + hq
    BITS = BITS + hq * words
    if DROP:
        inv_keep = _inv_keep(threshold, ACC)
    dk = tl.zeros([BN, D], ACC)
    dv = tl.zeros([BN, D], ACC)
    for m0 in range(0, Lq, BM):
        i = m0 + tl.arange(0, BM)
        im = i < Lq
        qT = _cols_of(Q, s_q, i, im, D)
        lse = tl.load(LSE + i, mask=im, other=float("inf"))
        sT = tile_dot(k, qT, DT, IEEE).to(ACC) * scale
        pT = tl.where(jm[:, None], _exp(sT - lse[None, :], EXP2), 0.0)
        do = _rows_of(DO, s_do, i, im, D)
        dpT = tile_dot(v, tl.trans(do), DT, IEEE).to(ACC)
        if DROP:
            kept = _kept_by_keys(BITS, i, im, pid * BN, words, BM, BN)
            zpT = tl.where(kept, pT * inv_keep, 0.0)
            dpT = tl.where(kept, dpT * inv_keep, 0.0)
        else:
            zpT = pT
        dv += tile_dot(zpT.to(DT), do, DT, IEEE).to(ACC)
        delta = tl.load(DELTA + i, mask=im, other=0.0)
        dsT = pT * (dpT - delta[None, :])
        dk += tile_dot(dsT.to(DT), tl.trans(qT), DT, IEEE).to(ACC)
    if EXP2:
        scale = scale / 1.4426950408889634
    _store_rows(DK + k0 * s_dk + hd, s_dk, j, jm, dk * scale, D)
    _store_rows(DV + k0 * s_dv + hd, s_dv, j, jm, dv, D)


@triton.jit
def _dq(Q, K, V, DO, LSE, DELTA, DQ, BITS, cu_q, cu_k, s_q, s_k, s_v, s_do, s_dq, Nq, words, scale_hi, scale_lo,
        threshold, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DROP: tl.constexpr, DT: tl.constexpr,
        IEEE: tl.constexpr, EXP2: tl.constexpr, ACC: tl.constexpr):
    pid, h, q0, Lq, k0, Lk = _program(cu_q, cu_k)
    if pid * BM >= Lq:
        return
    scale = _scale_of(scale_hi, scale_lo, EXP2, ACC)
    i = pid * BM + tl.arange(0, BM)
    im = i < Lq
    hd = h * D
    hq = h.to(tl.int64) * Nq + q0
    q = _rows_of(Q + q0 * s_q + hd, s_q, i, im, D)
    do = _rows_of(DO + q0 * s_do + hd, s_do, i, im, D)
    lse = tl.load(LSE + hq + i, mask=im, other=float("inf"))
    delta = tl.load(DELTA + hq + i, mask=im, other=0.0)
    K = K + k0 * s_k + hd
    V = V + k0 * s_v + hd
    BITS = BITS + hq * words
    if DROP:
        inv_keep = _inv_keep(threshold, ACC)
    dq = tl.zeros([BM, D], ACC)
    for n0 in range(0, Lk, BN):
        jm, j, kT, s = _key_scores(q, K, s_k, Lk, n0, scale, D, BN, DT, IEEE, ACC)
        vT = _cols_of(V, s_v, j, jm, D)
        p = tl.where(jm[None, :], _exp(s - lse[:, None], EXP2), 0.0)
        dp = tile_dot(do, vT, DT, IEEE).to(ACC)
        if DROP:
            dp = tl.where(_kept(BITS, i, im, n0, words, BM, BN), dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])
        dq += tile_dot(ds.to(DT), tl.trans(kT), DT, IEEE).to(ACC)
    if EXP2:
        scale = scale / 1.4426950408889634
    _store_rows(DQ + q0 * s_dq + hd, s_dq, i, im, dq * scale, D)


def _meta(q, p):
    DT = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
          torch.float64: tl.float64}[q.dtype]
    return (dict(DT=DT, IEEE=q.dtype == torch.float32, EXP2=q.dtype != torch.float64, ACC=acc_tl_dtype(q)),
            _threshold(p))


def _words(max_k: int, Nq: int) -> int:
    """32-bit words of the dropout's bits per query row; refuses a batch whose Philox counters would wrap."""
    words = max(1, -(-int(max_k) // 32))
    if 2 * Nq * words >= 1 << 32:
        raise ValueError(f"varlen attention: {Nq} query rows × {words} words of dropout bits exceed the Philox "
                         "counter's 2³¹ words; use fewer rows per call")
    return words


def _check(q, k, v, cu_q, cu_k, p, max_q, max_k, by_queries=(), by_keys=()):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3 or t.stride(-1) != 1 or t.stride(1) != t.shape[-1]:
            raise ValueError(f"varlen attention: {name} must be [N, H, D] with unit stride along D and D along H, "
                             f"got shape {tuple(t.shape)} strides {t.stride()}")
    if k.shape[1:] != q.shape[1:] or v.shape != k.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"varlen attention: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype} and v "
                         f"{tuple(v.shape)} {v.dtype} must share heads, width and dtype")
    if not supports(q, p):
        raise ValueError(f"varlen attention: head width {q.shape[-1]} (a power of two from 16 to 256), dtype "
                         f"{q.dtype} or dropout p={p} (0, or a rate p rounded to 1/256 between 0 and 1) not "
                         "supported")
    if cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32 or cu_q.shape != cu_k.shape or cu_q.dim() != 1:
        raise ValueError("varlen attention: cu_q and cu_k must be int32 [B + 1] offsets")
    for name, rows, tensors in (("max_q", max_q, (q,) + tuple(by_queries)), ("max_k", max_k, (k, v) + tuple(by_keys))):
        stride = max([q.shape[1] * q.shape[2]] + [t.stride(0) for t in tensors])  # the outputs' own: H·D
        if int(rows) * stride >= _OFFSETS:
            raise ValueError(f"varlen attention: {name}={int(rows)} rows of stride {stride} exceed the kernels' 32-bit "
                             "offsets within a sequence (2³¹ elements)")


def keep_bits(key, heads: int, Nq: int, max_k: int, p: float) -> torch.Tensor:
    """The dropout's bits for `key` (module docstring): int32 [heads, Nq, ⌈max_k / 32⌉]."""
    words = _words(max_k, Nq)
    bits = torch.empty(heads, Nq, words, dtype=torch.int32, device=key.device)
    if Nq and heads:
        BR = 32
        _keep_words[(triton.cdiv(Nq, BR), heads)](bits, key, Nq, words, _threshold(p), BR=BR,
                                                  BW=triton.next_power_of_2(words))
    return bits


def forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, p: float = 0.0, key=None,
            covered: bool = False):
    """``(out [Nq, H, D], lse [H, Nq] in the kernels' units, bits)``: `bits`, the dropout's (`keep_bits` of `key`,
    a `draw_key`, required when p > 0), None without dropout. `max_q`, `max_k`: at least the longest sequence's
    queries and keys. `covered`: every query row lies in some sequence (rows of none are written 0 otherwise, one
    more pass)."""
    _check(q, k, v, cu_q, cu_k, p, max_q, max_k)
    Nq, H, D = q.shape
    meta, t = _meta(q, p)
    drop = t > 0
    if drop and key is None:
        raise ValueError("varlen attention: a dropout key (draw_key) is required when p > 0")
    out = (torch.empty if covered else torch.zeros)(Nq, H, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(H, Nq, device=q.device, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    bits = keep_bits(key, H, Nq, max_k, p) if drop else None
    B = cu_q.shape[0] - 1
    if Nq == 0 or B == 0 or max_q == 0:
        return out, lse, bits
    BM, BN, W, S = _tiles("forward", q.dtype)
    hi, lo = split_scalar(scale)
    _forward[(triton.cdiv(max_q, BM), B, H)](
        q, k, v, out, lse, bits if drop else cu_q, cu_q, cu_k, q.stride(0), k.stride(0), v.stride(0), out.stride(0),
        Nq, _words(max_k, Nq), hi, lo, t, D=D, BM=BM, BN=BN, DROP=drop, num_warps=W, num_stages=S, **meta)
    return out, lse, bits


def backward(do, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, scale: float, p: float = 0.0, bits=None,
             dq=None, dk=None, dv=None, covered: bool = False):
    """``(dq, dk, dv)``, each [N, H, D], given `forward`'s `out`, `lse` and `bits`; written into `dq`, `dk`, `dv`
    where given (any row stride, as `q`'s). `covered`: every query row and every key row lies in some sequence
    (otherwise the gradients are zeroed first, so that rows of none get 0)."""
    Nq, H, D = q.shape
    _check(q, k, v, cu_q, cu_k, p, max_q, max_k, [x for x in (do, out, dq) if x is not None],
           [x for x in (dk, dv) if x is not None])
    meta, t = _meta(q, p)
    drop = t > 0
    if drop and bits is None:
        raise ValueError("varlen attention: the forward's dropout bits are required when p > 0")
    dq = torch.empty_like(q, memory_format=torch.contiguous_format) if dq is None else dq
    dk = torch.empty_like(k, memory_format=torch.contiguous_format) if dk is None else dk
    dv = torch.empty_like(v, memory_format=torch.contiguous_format) if dv is None else dv
    if not covered:
        for grad in (dq, dk, dv):
            grad.zero_()
    B = cu_q.shape[0] - 1
    if Nq == 0 or B == 0:
        return dq, dk, dv
    delta = torch.empty_like(lse)
    BR = 64 if q.dtype != torch.float64 else 16
    _delta[(triton.cdiv(Nq, BR), H)](out, do, delta, out.stride(0), do.stride(0), Nq, D=D, BR=BR, ACC=meta["ACC"])
    hi, lo = split_scalar(scale)
    words = _words(max_k, Nq)
    bits = bits if drop else cu_q
    BM, BN, W, S = _tiles("dkdv", q.dtype)
    if max_k:
        _dkdv[(triton.cdiv(max_k, BN), B, H)](
            q, k, v, do, lse, delta, dk, dv, bits, cu_q, cu_k, q.stride(0), k.stride(0), v.stride(0), do.stride(0),
            dk.stride(0), dv.stride(0), Nq, words, hi, lo, t, D=D, BM=BM, BN=BN, DROP=drop, num_warps=W,
            num_stages=S, **meta)
    BM, BN, W, S = _tiles("dq", q.dtype)
    _dq[(triton.cdiv(max_q, BM), B, H)](
        q, k, v, do, lse, delta, dq, bits, cu_q, cu_k, q.stride(0), k.stride(0), v.stride(0), do.stride(0),
        dq.stride(0), Nq, words, hi, lo, t, D=D, BM=BM, BN=BN, DROP=drop, num_warps=W, num_stages=S, **meta)
    return dq, dk, dv


def keep_mask(key, cu_q, cu_k, heads: int, max_q: int, max_k: int, p: float, Nq: int | None = None) -> torch.Tensor:
    """The kernels' keep mask as bool [B, heads, max_q, max_k] (False outside each sequence's queries and keys),
    decoded from `keep_bits`."""
    B = cu_q.shape[0] - 1
    Nq = int(cu_q[-1]) if Nq is None else Nq
    words = keep_bits(key, heads, Nq, max_k, p).long() & 0xFFFFFFFF
    flat = ((words[..., None] >> torch.arange(32, device=words.device)) & 1).bool().flatten(2)  # [H, Nq, 32·words]
    m = torch.zeros(B, heads, max_q, max_k, dtype=torch.bool, device=cu_q.device)
    for b in range(B):
        q0, q1 = int(cu_q[b]), int(cu_q[b + 1])
        lk = int(cu_k[b + 1]) - int(cu_k[b])
        m[b, :, :q1 - q0, :lk] = flat[:, q0:q1, :lk]
    return m
