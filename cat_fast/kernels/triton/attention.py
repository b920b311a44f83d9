"""Full attention whose backward is itself differentiable (`cat_fast.layers.double_attention`): a forward, its
backward, and the backward of that backward, each a tiled kernel that recomputes the probabilities from the scores
and never writes a ``[T, T]`` tensor of scores (what exact gradient supervision needs: the double backward through
every layer).

Layout: every ``[B, H, T, D]`` tensor is the head view of a token-major ``[B, T, H, D]`` buffer (strides
``(T·H·D, D, H·D, 1)``: what a Hugging Face attention module hands over, ``x.view(B, T, H, D).transpose(1, 2)``),
queries ``q``, ``do`` with TQ rows and keys ``k``, ``v`` with TK rows; an additive score bias ``[B|1, H|1, TQ|1,
TK]`` of any strides (stride 0 for broadcast); an optional uint8 keep mask ``[B, H, TQ, TK]`` (contiguous, 1 = kept)
for the attention dropout, whose kept probabilities are multiplied by ``inv_keep``. The statistics of a row: its
maximum score (0 where every score is -inf) and the softmax's inverse denominator (0 there, so that such a row's
probabilities are 0), kept apart rather than as a log-sum-exp, which loses the denominator beside scores of HF's
masking minimum.

With ``S = scale·QKᵀ + bias``, ``P = softmax(S)``, ``Z = keep·inv_keep``: ``O = (P∘Z) V``. The backward, with
``Δ = rowsum(dO∘O)``: ``dV = (P∘Z)ᵀ dO``, ``dP = Z∘(dO Vᵀ)``, ``dS = P∘(dP − Δ)``, ``dQ = scale·dS K``,
``dK = scale·dSᵀ Q``. The double backward, for cotangents ``A``, ``Bk``, ``C`` of dQ, dK, dV: ``G = scale·(A Kᵀ +
Q Bkᵀ)``, ``E = rowsum(G∘P)``; ``G_P = G∘(dP − Δ) − E∘dP + Z∘(dO Cᵀ)``, ``F = rowsum(P∘G_P)``, ``G_S = P∘(G_P −
F)``, ``G_dP = Z∘P∘(G − E)``; then ``gQ = scale·(dS Bk + G_S K)``, ``gK = scale·(dSᵀ A + G_Sᵀ Q)``,
``gV = G_dPᵀ dO``, ``gdO = (P∘Z) C + G_dP V``. A row pass computes E and F (F = Σ P G (dP − Δ) − E Δ + Σ P Z (dO Cᵀ),
one loop) and then gQ and gdO; a column pass gK and gV.

Keys whose bias is -inf in every head and row of a sequence add exactly 0 to every sum of every pass (their
probabilities are 0). So each sequence's kernels visit only the tiles of keys from its first to its last key that
some score attends (`key_span`: what a padded batch's mask leaves, right- or left-padded), and a column program of
keys outside that span writes its zeros without a loop. The sums over the visited tiles are the same sums, in the
same order, as over all of them.
"""
import torch
import triton
import triton.language as tl

from ._common import acc_tl_dtype, pow2_at_least, scalar_acc, split_scalar, tile_dot

__all__ = ["forward", "backward", "double_backward", "key_span", "token_major", "BLOCK", "NUM_WARPS", "TILES"]

# rows and keys per tile for 16-bit inputs (at most; 16 at least, tl.dot's smallest; fp32 takes at most 32 and
# float64 16, which fit the double backward's tiles in shared memory) and warps per program
BLOCK = 64
NUM_WARPS = 4
_WIDEST = {torch.float32: 32, torch.float64: 16}
# per kernel, for 16-bit inputs: (rows per tile, keys per tile, warps, pipeline stages), a None for BLOCK, NUM_WARPS or
# Triton's default stages. A row pass's programs take 64 rows and step over keys 32 at a time, a column pass's the
# reverse, which beat 64 x 64 tiles for each of these kernels on an H200 at the step suite's 64 x 256 batches
# (benchmarks/tools/attention_tiles.py, benchmarks/RESULTS.md); the forward was not swept and stays at BLOCK
TILES = {"dq": (64, 32, 4, None), "dkdv": (32, 64, 4, None), "dd_rows": (64, 32, 4, None),
         "dd_cols": (32, 64, 4, None)}
_SIXTEEN = (torch.float16, torch.bfloat16)


@triton.jit
def _rows(ptr, b, h, T, H, rows, rm, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The ``[len(rows), BLOCK_D]`` tile of head h of sequence b of a token-major tensor (0 outside)."""
    d = tl.arange(0, BLOCK_D)
    offs = (b.to(tl.int64) * T + rows.to(tl.int64)[:, None]) * (H * D) + h * D + d[None, :]
    return tl.load(ptr + offs, mask=rm[:, None] & (d < D)[None, :], other=0.0)


@triton.jit
def _store_rows(ptr, x, b, h, T, H, rows, rm, D: tl.constexpr, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    offs = (b.to(tl.int64) * T + rows.to(tl.int64)[:, None]) * (H * D) + h * D + d[None, :]
    tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=rm[:, None] & (d < D)[None, :])


@triton.jit
def _probs(q, k, i, im, j, jm, b, h, bh, TQ, TK, bias_ptr, sb_b, sb_h, sb_i, sb_j, keep_ptr, scale, inv_keep, m_i,
           inv_l, DT: tl.constexpr, IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
           ACC: tl.constexpr):
    """(P, Z) of a tile: the probabilities from the rows' statistics, and the dropout factor (1 without)."""
    s = _scores(q, k, i, im, j, jm, b, h, bias_ptr, sb_b, sb_h, sb_i, sb_j, scale, DT, IEEE, HAS_BIAS, ACC)
    p = tl.exp(s - m_i[:, None]) * inv_l[:, None]
    return p, _keep(keep_ptr, bh, TQ, TK, i, im, j, jm, inv_keep, HAS_DROPOUT, ACC)


@triton.jit
def _scores(q, k, i, im, j, jm, b, h, bias_ptr, sb_b, sb_h, sb_i, sb_j, scale, DT: tl.constexpr,
            IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, ACC: tl.constexpr):
    s = tile_dot(q, tl.trans(k), DT, IEEE).to(ACC) * scale
    if HAS_BIAS:
        s += tl.load(bias_ptr + b.to(tl.int64) * sb_b + h * sb_h + i.to(tl.int64)[:, None] * sb_i
                     + j.to(tl.int64)[None, :] * sb_j, mask=im[:, None] & jm[None, :], other=0.0).to(ACC)
    return tl.where(jm[None, :], s, float("-inf"))


@triton.jit
def _keep(keep_ptr, bh, TQ, TK, i, im, j, jm, inv_keep, HAS_DROPOUT: tl.constexpr, ACC: tl.constexpr):
    if HAS_DROPOUT:
        kept = tl.load(keep_ptr + (bh * TQ + i.to(tl.int64))[:, None] * TK + j[None, :],
                       mask=im[:, None] & jm[None, :], other=0)
        z = tl.where(kept != 0, inv_keep, 0.0).to(ACC)
    else:
        z = tl.full([1, 1], 1.0, ACC)
    return z


@triton.jit
def _program(H, BLOCK: tl.constexpr, AXIS_T):
    """(b, h, bh, this program's block of rows or keys and its mask)."""
    bh = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    return bh // H, bh % H, bh, t, t < AXIS_T


@triton.jit
def _span(span_ptr, b, ss_b, TK, HAS_SPAN: tl.constexpr):
    """The first and one past the last key of sequence b that some score attends (`key_span`; all keys without)."""
    if HAS_SPAN:
        return tl.load(span_ptr + b * ss_b), tl.load(span_ptr + b * ss_b + 1)
    return 0, TK


@triton.jit
def _key_tiles_of(span_ptr, b, ss_b, TK, BLOCK_N: tl.constexpr, HAS_SPAN: tl.constexpr):
    """(first, end) of the loop over the key tiles of sequence b: the tiles that hold its span, aligned as all."""
    lo, hi = _span(span_ptr, b, ss_b, TK, HAS_SPAN)
    return (lo // BLOCK_N) * BLOCK_N, tl.where(hi > lo, hi, 0)


@triton.jit
def _rows_for(span_ptr, b, ss_b, TK, TQ, HAS_SPAN: tl.constexpr, BLOCK_N: tl.constexpr):
    """The end of a column program's loop over query rows: TQ, or 0 where its keys lie outside the span."""
    lo, hi = _span(span_ptr, b, ss_b, TK, HAS_SPAN)
    j0 = tl.program_id(0) * BLOCK_N
    return tl.where((j0 + BLOCK_N > lo) & (j0 < hi), TQ, 0)


@triton.jit
def _row_stats(stats_ptr, delta_ptr, bh, TQ, i, im):
    rows = bh * TQ + i.to(tl.int64)
    m_i = tl.load(stats_ptr + 2 * rows, mask=im, other=0.0)
    inv_l = tl.load(stats_ptr + 2 * rows + 1, mask=im, other=0.0)
    dl = tl.load(delta_ptr + rows, mask=im, other=0.0)
    return m_i, inv_l, dl


@triton.jit
def _forward_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, keep_ptr, span_ptr, o_ptr, stats_ptr, TQ, TK, H,
                    scale_hi, scale_lo, keep_hi, keep_lo, sb_b, sb_h, sb_i, sb_j, ss_b,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SPAN: tl.constexpr, IEEE: tl.constexpr,
                    ACC: tl.constexpr):
    b, h, bh, i, im = _program(H, BLOCK_M, TQ)
    n_lo, n_hi = _key_tiles_of(span_ptr, b, ss_b, TK, BLOCK_N, HAS_SPAN)
    DT = q_ptr.dtype.element_ty
    scale = scalar_acc(scale_hi, scale_lo, ACC)
    inv_keep = scalar_acc(keep_hi, keep_lo, ACC)
    q = _rows(q_ptr, b, h, TQ, H, i, im, D, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), ACC)
    l_sum = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        jm = j < TK
        k = _rows(k_ptr, b, h, TK, H, j, jm, D, BLOCK_D)
        s = _scores(q, k, i, im, j, jm, b, h, bias_ptr, sb_b, sb_h, sb_i, sb_j, scale, DT, IEEE, HAS_BIAS, ACC)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # every score so far -inf: no NaN from -inf - -inf
        alpha = tl.exp(m - m_safe)
        e = tl.exp(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(e, axis=1)
        w = e * _keep(keep_ptr, bh, TQ, TK, i, im, j, jm, inv_keep, HAS_DROPOUT, ACC)
        v = _rows(v_ptr, b, h, TK, H, j, jm, D, BLOCK_D)
        acc = acc * alpha[:, None] + tile_dot(w, v, DT, IEEE).to(ACC)
        m = m_new
    inv_l = tl.where(l_sum == 0.0, 0.0, 1.0 / tl.where(l_sum == 0.0, 1.0, l_sum))
    _store_rows(o_ptr, acc * inv_l[:, None], b, h, TQ, H, i, im, D, BLOCK_D)
    rows = stats_ptr + 2 * (bh * TQ + i.to(tl.int64))
    tl.store(rows, tl.where(m == float("-inf"), 0.0, m), mask=im)
    tl.store(rows + 1, inv_l, mask=im)


@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, bias_ptr, keep_ptr, span_ptr, stats_ptr, delta_ptr, dq_ptr, TQ, TK, H,
               scale_hi, scale_lo, keep_hi, keep_lo, sb_b, sb_h, sb_i, sb_j, ss_b,
               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SPAN: tl.constexpr, IEEE: tl.constexpr,
               ACC: tl.constexpr):
    b, h, bh, i, im = _program(H, BLOCK_M, TQ)
    n_lo, n_hi = _key_tiles_of(span_ptr, b, ss_b, TK, BLOCK_N, HAS_SPAN)
    DT = q_ptr.dtype.element_ty
    scale = scalar_acc(scale_hi, scale_lo, ACC)
    inv_keep = scalar_acc(keep_hi, keep_lo, ACC)
    q = _rows(q_ptr, b, h, TQ, H, i, im, D, BLOCK_D)
    do = _rows(do_ptr, b, h, TQ, H, i, im, D, BLOCK_D)
    m_i, inv_l, dl = _row_stats(stats_ptr, delta_ptr, bh, TQ, i, im)
    dq = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        jm = j < TK
        k = _rows(k_ptr, b, h, TK, H, j, jm, D, BLOCK_D)
        v = _rows(v_ptr, b, h, TK, H, j, jm, D, BLOCK_D)
        p, z = _probs(q, k, i, im, j, jm, b, h, bh, TQ, TK, bias_ptr, sb_b, sb_h, sb_i, sb_j, keep_ptr, scale,
                      inv_keep, m_i, inv_l, DT, IEEE, HAS_BIAS, HAS_DROPOUT, ACC)
        dp = tile_dot(do, tl.trans(v), DT, IEEE).to(ACC) * z
        dq += tile_dot(p * (dp - dl[:, None]), k, DT, IEEE).to(ACC)
    _store_rows(dq_ptr, dq * scale, b, h, TQ, H, i, im, D, BLOCK_D)


@triton.jit
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, bias_ptr, keep_ptr, span_ptr, stats_ptr, delta_ptr, dk_ptr, dv_ptr,
                 TQ, TK, H, scale_hi, scale_lo, keep_hi, keep_lo, sb_b, sb_h, sb_i, sb_j, ss_b,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SPAN: tl.constexpr, IEEE: tl.constexpr,
                 ACC: tl.constexpr):
    b, h, bh, j, jm = _program(H, BLOCK_N, TK)
    DT = q_ptr.dtype.element_ty
    scale = scalar_acc(scale_hi, scale_lo, ACC)
    inv_keep = scalar_acc(keep_hi, keep_lo, ACC)
    k = _rows(k_ptr, b, h, TK, H, j, jm, D, BLOCK_D)
    v = _rows(v_ptr, b, h, TK, H, j, jm, D, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    for m0 in range(0, _rows_for(span_ptr, b, ss_b, TK, TQ, HAS_SPAN, BLOCK_N), BLOCK_M):
        i = m0 + tl.arange(0, BLOCK_M)
        im = i < TQ
        q = _rows(q_ptr, b, h, TQ, H, i, im, D, BLOCK_D)
        do = _rows(do_ptr, b, h, TQ, H, i, im, D, BLOCK_D)
        m_i, inv_l, dl = _row_stats(stats_ptr, delta_ptr, bh, TQ, i, im)
        p, z = _probs(q, k, i, im, j, jm, b, h, bh, TQ, TK, bias_ptr, sb_b, sb_h, sb_i, sb_j, keep_ptr, scale,
                      inv_keep, m_i, inv_l, DT, IEEE, HAS_BIAS, HAS_DROPOUT, ACC)
        dp = tile_dot(do, tl.trans(v), DT, IEEE).to(ACC) * z
        dv += tile_dot(tl.trans(p * z), do, DT, IEEE).to(ACC)
        dk += tile_dot(tl.trans(p * (dp - dl[:, None])), q, DT, IEEE).to(ACC)
    _store_rows(dk_ptr, dk * scale, b, h, TK, H, j, jm, D, BLOCK_D)
    _store_rows(dv_ptr, dv, b, h, TK, H, j, jm, D, BLOCK_D)


@triton.jit
def _dd_tile(q, k, v, do, a, bk, c, i, im, j, jm, b, h, bh, TQ, TK, bias_ptr, sb_b, sb_h, sb_i, sb_j, keep_ptr,
             scale, inv_keep, m_i, inv_l, DT: tl.constexpr, IEEE: tl.constexpr, HAS_BIAS: tl.constexpr,
             HAS_DROPOUT: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr, HAS_C: tl.constexpr,
             ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(P, Z, dP, G, dO Cᵀ) of a tile (the module docstring's names; 0 for an absent cotangent)."""
    p, z = _probs(q, k, i, im, j, jm, b, h, bh, TQ, TK, bias_ptr, sb_b, sb_h, sb_i, sb_j, keep_ptr, scale, inv_keep,
                  m_i, inv_l, DT, IEEE, HAS_BIAS, HAS_DROPOUT, ACC)
    dp = tile_dot(do, tl.trans(v), DT, IEEE).to(ACC) * z
    g = tl.zeros([BLOCK_M, BLOCK_N], ACC)
    if HAS_A:
        g += tile_dot(a, tl.trans(k), DT, IEEE).to(ACC)
    if HAS_B:
        g += tile_dot(q, tl.trans(bk), DT, IEEE).to(ACC)
    doc = tl.zeros([BLOCK_M, BLOCK_N], ACC)
    if HAS_C:
        doc = tile_dot(do, tl.trans(c), DT, IEEE).to(ACC)
    return p, z, dp, g * scale, doc


@triton.jit
def _key_tiles(k_ptr, v_ptr, bk_ptr, c_ptr, b, h, TK, H, j, jm, D: tl.constexpr, BLOCK_D: tl.constexpr,
               HAS_B: tl.constexpr, HAS_C: tl.constexpr):
    """The k, v, Bk and C tiles of keys j (0 for an absent cotangent)."""
    return (_rows(k_ptr, b, h, TK, H, j, jm, D, BLOCK_D), _rows(v_ptr, b, h, TK, H, j, jm, D, BLOCK_D),
            _rows(bk_ptr, b, h, TK, H, j, jm & HAS_B, D, BLOCK_D), _rows(c_ptr, b, h, TK, H, j, jm & HAS_C, D, BLOCK_D))


@triton.jit
def _query_tiles(q_ptr, do_ptr, a_ptr, b, h, TQ, H, i, im, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 HAS_A: tl.constexpr):
    """The q, dO and A tiles of rows i (A 0 when absent)."""
    return (_rows(q_ptr, b, h, TQ, H, i, im, D, BLOCK_D), _rows(do_ptr, b, h, TQ, H, i, im, D, BLOCK_D),
            _rows(a_ptr, b, h, TQ, H, i, im & HAS_A, D, BLOCK_D))


@triton.jit
def _grad_scores(p, z, dp, g, doc, dl, e_sum, f_sum):
    """G_S = P∘(G_P − F), with G_P = G∘(dP − Δ) − E∘dP + Z∘(dO Cᵀ) (module docstring)."""
    return p * (g * (dp - dl[:, None]) - e_sum[:, None] * dp + z * doc - f_sum[:, None])


@triton.jit
def _dd_rows_kernel(q_ptr, k_ptr, v_ptr, do_ptr, a_ptr, bk_ptr, c_ptr, bias_ptr, keep_ptr, span_ptr, stats_ptr,
                    delta_ptr, ef_ptr, gq_ptr, gdo_ptr, TQ, TK, H, scale_hi, scale_lo, keep_hi, keep_lo, sb_b, sb_h,
                    sb_i, sb_j, ss_b, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SPAN: tl.constexpr,
                    HAS_A: tl.constexpr, HAS_B: tl.constexpr, HAS_C: tl.constexpr, IEEE: tl.constexpr,
                    ACC: tl.constexpr):
    b, h, bh, i, im = _program(H, BLOCK_M, TQ)
    n_lo, n_hi = _key_tiles_of(span_ptr, b, ss_b, TK, BLOCK_N, HAS_SPAN)
    DT = q_ptr.dtype.element_ty
    scale = scalar_acc(scale_hi, scale_lo, ACC)
    inv_keep = scalar_acc(keep_hi, keep_lo, ACC)
    q, do, a = _query_tiles(q_ptr, do_ptr, a_ptr, b, h, TQ, H, i, im, D, BLOCK_D, HAS_A)
    m_i, inv_l, dl = _row_stats(stats_ptr, delta_ptr, bh, TQ, i, im)
    e_sum = tl.zeros([BLOCK_M], ACC)
    f_sum = tl.zeros([BLOCK_M], ACC)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        jm = j < TK
        k, v, bk, c = _key_tiles(k_ptr, v_ptr, bk_ptr, c_ptr, b, h, TK, H, j, jm, D, BLOCK_D, HAS_B, HAS_C)
        p, z, dp, g, doc = _dd_tile(q, k, v, do, a, bk, c, i, im, j, jm, b, h, bh, TQ, TK, bias_ptr, sb_b, sb_h,
                                    sb_i, sb_j, keep_ptr, scale, inv_keep, m_i, inv_l, DT, IEEE, HAS_BIAS,
                                    HAS_DROPOUT, HAS_A, HAS_B, HAS_C, ACC, BLOCK_M, BLOCK_N)
        e_sum += tl.sum(g * p, axis=1)
        f_sum += tl.sum(p * (g * (dp - dl[:, None]) + z * doc), axis=1)
    f_sum -= e_sum * dl
    gq = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    gdo = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        jm = j < TK
        k, v, bk, c = _key_tiles(k_ptr, v_ptr, bk_ptr, c_ptr, b, h, TK, H, j, jm, D, BLOCK_D, HAS_B, HAS_C)
        p, z, dp, g, doc = _dd_tile(q, k, v, do, a, bk, c, i, im, j, jm, b, h, bh, TQ, TK, bias_ptr, sb_b, sb_h,
                                    sb_i, sb_j, keep_ptr, scale, inv_keep, m_i, inv_l, DT, IEEE, HAS_BIAS,
                                    HAS_DROPOUT, HAS_A, HAS_B, HAS_C, ACC, BLOCK_M, BLOCK_N)
        gs = _grad_scores(p, z, dp, g, doc, dl, e_sum, f_sum)
        gq += tile_dot(gs, k, DT, IEEE).to(ACC)
        if HAS_B:
            gq += tile_dot(p * (dp - dl[:, None]), bk, DT, IEEE).to(ACC)
        gdo += tile_dot(z * p * (g - e_sum[:, None]), v, DT, IEEE).to(ACC)
        if HAS_C:
            gdo += tile_dot(p * z, c, DT, IEEE).to(ACC)
    _store_rows(gq_ptr, gq * scale, b, h, TQ, H, i, im, D, BLOCK_D)
    _store_rows(gdo_ptr, gdo, b, h, TQ, H, i, im, D, BLOCK_D)
    rows = ef_ptr + 2 * (bh * TQ + i.to(tl.int64))
    tl.store(rows, e_sum, mask=im)
    tl.store(rows + 1, f_sum, mask=im)


@triton.jit
def _dd_cols_kernel(q_ptr, k_ptr, v_ptr, do_ptr, a_ptr, bk_ptr, c_ptr, bias_ptr, keep_ptr, span_ptr, stats_ptr,
                    delta_ptr, ef_ptr, gk_ptr, gv_ptr, TQ, TK, H, scale_hi, scale_lo, keep_hi, keep_lo, sb_b, sb_h,
                    sb_i, sb_j, ss_b, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SPAN: tl.constexpr,
                    HAS_A: tl.constexpr, HAS_B: tl.constexpr, HAS_C: tl.constexpr, IEEE: tl.constexpr,
                    ACC: tl.constexpr):
    b, h, bh, j, jm = _program(H, BLOCK_N, TK)
    DT = q_ptr.dtype.element_ty
    scale = scalar_acc(scale_hi, scale_lo, ACC)
    inv_keep = scalar_acc(keep_hi, keep_lo, ACC)
    k, v, bk, c = _key_tiles(k_ptr, v_ptr, bk_ptr, c_ptr, b, h, TK, H, j, jm, D, BLOCK_D, HAS_B, HAS_C)
    gk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    gv = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    for m0 in range(0, _rows_for(span_ptr, b, ss_b, TK, TQ, HAS_SPAN, BLOCK_N), BLOCK_M):
        i = m0 + tl.arange(0, BLOCK_M)
        im = i < TQ
        q, do, a = _query_tiles(q_ptr, do_ptr, a_ptr, b, h, TQ, H, i, im, D, BLOCK_D, HAS_A)
        m_i, inv_l, dl = _row_stats(stats_ptr, delta_ptr, bh, TQ, i, im)
        rows = ef_ptr + 2 * (bh * TQ + i.to(tl.int64))
        e_sum = tl.load(rows, mask=im, other=0.0)
        f_sum = tl.load(rows + 1, mask=im, other=0.0)
        p, z, dp, g, doc = _dd_tile(q, k, v, do, a, bk, c, i, im, j, jm, b, h, bh, TQ, TK, bias_ptr, sb_b, sb_h,
                                    sb_i, sb_j, keep_ptr, scale, inv_keep, m_i, inv_l, DT, IEEE, HAS_BIAS,
                                    HAS_DROPOUT, HAS_A, HAS_B, HAS_C, ACC, BLOCK_M, BLOCK_N)
        gs = _grad_scores(p, z, dp, g, doc, dl, e_sum, f_sum)
        gk += tile_dot(tl.trans(gs), q, DT, IEEE).to(ACC)
        if HAS_A:
            gk += tile_dot(tl.trans(p * (dp - dl[:, None])), a, DT, IEEE).to(ACC)
        gv += tile_dot(tl.trans(z * p * (g - e_sum[:, None])), do, DT, IEEE).to(ACC)
    _store_rows(gk_ptr, gk * scale, b, h, TK, H, j, jm, D, BLOCK_D)
    _store_rows(gv_ptr, gv, b, h, TK, H, j, jm, D, BLOCK_D)


def token_major(t):
    """`t` ``[B, H, T, D]`` as the head view of a contiguous ``[B, T, H, D]`` buffer (itself where it is one)."""
    B, H, T, D = t.shape
    if t.stride() == (T * H * D, D, H * D, 1) or t.numel() == 0:
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def empty_token_major(B, H, T, D, like):
    return torch.empty(B, T, H, D, device=like.device, dtype=like.dtype).transpose(1, 2)


def key_span(bias):
    """``[B|1, 2]`` int32: per sequence, its first key and one past its last key whose score bias is not -inf in
    some head and row (start TK and end 0 where there is none); None without a bias. Reads each broadcast dimension
    of `bias` once."""
    if bias is None:
        return None
    t = bias
    for d in range(3):
        if t.stride(d) == 0 and t.shape[d] > 1:
            t = t.narrow(d, 0, 1)
    attended = (t != float("-inf")).flatten(1, 2).any(1)  # [B|1, TK]
    TK = attended.shape[-1]
    index = torch.arange(TK, device=bias.device, dtype=torch.int32)
    start = torch.where(attended, index, TK).amin(-1)
    end = torch.where(attended, index + 1, 0).amax(-1)
    return torch.stack((start, end), -1).to(torch.int32)


def _launch(q, k, bias, keep, span, scale, inv_keep, kernel):
    """The arguments `kernel` shares with the others after its tensors, its tile sizes and flags."""
    B, H, TQ, D = q.shape
    TK = k.shape[2]
    sb = bias.stride() if bias is not None else (0, 0, 0, 0)
    ss_b = span.stride(0) if span is not None and span.shape[0] > 1 else 0
    widest = min(BLOCK, _WIDEST.get(q.dtype, BLOCK))
    rows, keys, warps, stages = TILES.get(kernel, (None,) * 4) if q.dtype in _SIXTEEN else (None,) * 4
    block_m = max(16, min(rows or widest, pow2_at_least(TQ)))
    block_n = max(16, min(keys or widest, pow2_at_least(TK)))
    args = (TQ, TK, H, *split_scalar(scale), *split_scalar(inv_keep), *sb, ss_b)
    flags = dict(D=D, BLOCK_D=max(16, pow2_at_least(D)), BLOCK_M=block_m, BLOCK_N=block_n,
                 HAS_BIAS=bias is not None, HAS_DROPOUT=keep is not None, HAS_SPAN=span is not None,
                 IEEE=q.dtype == torch.float32, ACC=acc_tl_dtype(q), num_warps=warps or NUM_WARPS)
    if stages:
        flags["num_stages"] = stages
    return args, flags, (B, H, TQ, TK, D, block_m, block_n)


def _acc(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def forward(q, k, v, bias, keep, span, scale: float, inv_keep: float):
    """``(out, stats)``: the attention of token-major ``q``, ``k``, ``v`` (module docstring), out token-major in
    q's dtype, stats ``[B, H, TQ, 2]`` (the rows' maximum score and inverse denominator) at the accumulation
    precision. `span`: ``key_span(bias)``, which the backward passes take again. Shapes, dtypes and strides are
    checked by the caller (`cat_fast.layers.double_attention`)."""
    args, flags, (B, H, TQ, TK, D, bm, _) = _launch(q, k, bias, keep, span, scale, inv_keep, "forward")
    out = empty_token_major(B, H, TQ, D, q)
    stats = torch.empty(B, H, TQ, 2, device=q.device, dtype=_acc(q))
    _forward_kernel[(triton.cdiv(TQ, bm), B * H)](
        q, k, v, *_optional(q, bias, keep, span), out, stats, *args, **flags)
    return out, stats


def _optional(q, *tensors):
    """The pointer arguments of tensors that may be absent (q in their place: a kernel's flag leaves it unread)."""
    return tuple(t if t is not None else q for t in tensors)


def delta(do, out):
    """``Δ = rowsum(dO∘O)`` ``[B, H, TQ]`` at the accumulation precision."""
    acc = _acc(out)
    return (do.to(acc) * out.to(acc)).sum(-1).contiguous()


def backward(do, q, k, v, stats, dl, bias, keep, span, scale: float, inv_keep: float):
    """``(dq, dk, dv)``, token-major in the inputs' dtype, for the output gradient `do` (token-major),
    ``dl = delta(do, out)`` and the forward's `span`."""
    B, H, TQ, D = q.shape
    TK = k.shape[2]
    dq = empty_token_major(B, H, TQ, D, q)
    dk = empty_token_major(B, H, TK, D, k)
    dv = empty_token_major(B, H, TK, D, v)
    extra = (*_optional(q, bias, keep, span), stats, dl)
    args, flags, (*_, bm, _) = _launch(q, k, bias, keep, span, scale, inv_keep, "dq")
    _dq_kernel[(triton.cdiv(TQ, bm), B * H)](q, k, v, do, *extra, dq, *args, **flags)
    args, flags, (*_, bn) = _launch(q, k, bias, keep, span, scale, inv_keep, "dkdv")
    _dkdv_kernel[(triton.cdiv(TK, bn), B * H)](q, k, v, do, *extra, dk, dv, *args, **flags)
    return dq, dk, dv


def double_backward(ga, gb, gc, q, k, v, do, stats, dl, bias, keep, span, scale: float, inv_keep: float):
    """``(gq, gk, gv, gdo)``: the gradients of ``<ga, dq> + <gb, dk> + <gc, dv>`` (each cotangent token-major, or
    None for 0) with respect to q, k, v and do, token-major in the inputs' dtype."""
    B, H, TQ, D = q.shape
    TK = k.shape[2]
    given = dict(HAS_A=ga is not None, HAS_B=gb is not None, HAS_C=gc is not None)
    gq = empty_token_major(B, H, TQ, D, q)
    gdo = empty_token_major(B, H, TQ, D, do)
    gk = empty_token_major(B, H, TK, D, k)
    gv = empty_token_major(B, H, TK, D, v)
    ef = torch.empty(B, H, TQ, 2, device=q.device, dtype=_acc(q))
    extra = (*_optional(q, ga, gb, gc), *_optional(q, bias, keep, span), stats, dl, ef)
    args, flags, (*_, bm, _) = _launch(q, k, bias, keep, span, scale, inv_keep, "dd_rows")
    _dd_rows_kernel[(triton.cdiv(TQ, bm), B * H)](q, k, v, do, *extra, gq, gdo, *args, **flags, **given)
    args, flags, (*_, bn) = _launch(q, k, bias, keep, span, scale, inv_keep, "dd_cols")
    _dd_cols_kernel[(triton.cdiv(TK, bn), B * H)](q, k, v, do, *extra, gk, gv, *args, **flags, **given)
    return gq, gk, gv, gdo
