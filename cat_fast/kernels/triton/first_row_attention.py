"""Attention for one query row per sequence (the first-token layer's attention, `cat_fast.layers.attention`): one
program per (sequence, head) reads that head's keys and values once in the forward (an online softmax over key
tiles) and once in the backward, which writes the key and value gradients directly (timings against SDPA:
`benchmarks/tools/first_row_attention.py`, benchmarks/RESULTS.md).

Layout: ``q [B, 1, H*D]``, ``k``/``v`` ``[B, T, H*D]`` (head h in columns ``h*D .. h*D+D-1``, unit column stride,
any batch and row strides: ``k`` and ``v`` may be the two halves of one ``[B, T, 2*H*D]`` tensor), an additive
score bias ``[B, H or 1, T]`` of any strides (stride 0 for broadcast), an optional keep mask ``[B, H, T]`` (uint8,
1 = kept) for the attention dropout, whose kept probabilities are multiplied by `inv_keep`.

Packed keys (``rows``: the first-token layer over padding-free rows, `cat_fast.layers.packing`): ``k``/``v`` are
``[N, H*D]`` rows of the B sequences' tokens and ``rows = (seq, key_rows, positions, T)``: the keys of sequence b
are rows ``seq[b] .. seq[b+1]-1`` (int32 offsets, B + 1) of ``k``/``v``, or where ``key_rows`` (int64) is given the
rows ``key_rows[seq[b]] ..`` it lists; ``positions`` (int64 [N]) gives each row's index ``b*T + t`` in the padded
``[B, T]`` layout, by which the keep mask ``[B, H, T]`` is read (the padded call's draws for the same keys); no
bias (every listed key attends). The backward writes the listed rows of ``dk``/``dv`` only (the caller zeroes the
others).

``s_t = scale * q.k_t + bias_t``; ``p = softmax(s)`` (0 where every score is -inf); ``out = sum_t p_t keep_t inv_keep
v_t``. The forward saves the scores, their maximum, the softmax's inverse denominator and the output at the
accumulation precision (fp32; float64 for float64) for the backward: ``dp_t = keep_t inv_keep (v_t.do)``,
``ds_t = p_t (dp_t - out.do)``, ``dq = scale sum_t ds_t k_t``, ``dk_t = scale ds_t q``, ``dv_t = p_t keep_t
inv_keep do``.
"""
import torch
import triton
import triton.language as tl

from ._common import acc_tl_dtype, pow2_at_least, scalar_acc, split_scalar

__all__ = ["forward", "backward", "BLOCK_T", "NUM_WARPS"]

# key rows per tile (the loop over keys), at most; warps per program: the fastest or within 1 µs of it at the step
# suite's sizes in `benchmarks/tools/first_row_attention.py --sweep` (benchmarks/RESULTS.md)
BLOCK_T = 128
NUM_WARPS = 4


@triton.jit
def _program(q_ptr, sq_b, H, scale_hi, scale_lo, keep_hi, keep_lo, D: tl.constexpr, BLOCK_D: tl.constexpr,
             ACC: tl.constexpr):
    """This program's sequence b, its (sequence, head) row of scores / keep / stats / out_acc, the head's columns
    (d, their mask, col), its query at ACC, and the scale and keep factor at ACC (Triton passes floats as fp32:
    float64 needs both halves)."""
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    col = h * D + d
    q = tl.load(q_ptr + b * sq_b + col, mask=dm, other=0.0).to(ACC)
    return (b, b * H + h, d, dm, col, q, scalar_acc(scale_hi, scale_lo, ACC), scalar_acc(keep_hi, keep_lo, ACC))


@triton.jit
def _key_tile(seq_ptr, keyrow_ptr, pos_ptr, b, t0, T, n, BLOCK_T: tl.constexpr, PACKED: tl.constexpr,
              GATHERED: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """(t, its mask, the keys' row indices r, their keep-mask column) of a tile of keys t0 .. t0+BLOCK_T-1 of
    sequence b: padded, r = t (addressed as b * stride_b + r * stride_t) and column t; packed, r the packed row
    (addressed with stride_b = 0) and column its padded position."""
    t = t0 + tl.arange(0, BLOCK_T)
    tm = t < n
    r = t.to(tl.int64)
    kc = r
    if PACKED:
        r = tl.load(seq_ptr + b).to(tl.int64) + r
        if GATHERED:
            r = tl.load(keyrow_ptr + r, mask=tm, other=0)
        if HAS_DROPOUT:
            kc = tl.load(pos_ptr + r, mask=tm, other=0) - b * T
    return t, tm, r, kc


@triton.jit
def _key_count(seq_ptr, b, T, PACKED: tl.constexpr):
    """Sequence b's number of keys: T padded, its offsets' difference packed."""
    if PACKED:
        return tl.load(seq_ptr + b + 1) - tl.load(seq_ptr + b)
    return T


@triton.jit
def _first_row_forward_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, keep_ptr, seq_ptr, keyrow_ptr, pos_ptr, out_ptr,
                              out_acc_ptr, scores_ptr, stats_ptr, T, H, scale_hi, scale_lo, keep_hi, keep_lo,
                              sq_b, sk_b, sk_t, sv_b, sv_t, sb_b, sb_h, sb_t, so_b,
                              D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                              HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, ACC: tl.constexpr,
                              PACKED: tl.constexpr, GATHERED: tl.constexpr):
    b, row, d, dm, col, q, scale, inv_keep = _program(q_ptr, sq_b, H, scale_hi, scale_lo, keep_hi, keep_lo, D,
                                                      BLOCK_D, ACC)
    m = tl.full([1], float("-inf"), ACC)
    l_sum = tl.zeros([1], ACC)
    acc = tl.zeros([BLOCK_D], ACC)
    n = _key_count(seq_ptr, b, T, PACKED)
    for t0 in range(0, n, BLOCK_T):
        t, tm, r, kc = _key_tile(seq_ptr, keyrow_ptr, pos_ptr, b, t0, T, n, BLOCK_T, PACKED, GATHERED, HAS_DROPOUT)
        t64 = t.to(tl.int64)
        kt = tl.load(k_ptr + b * sk_b + r[:, None] * sk_t + col[None, :], mask=tm[:, None] & dm[None, :],
                     other=0.0).to(ACC)
        s = tl.sum(kt * q[None, :], axis=1) * scale
        if HAS_BIAS:
            s += tl.load(bias_ptr + b * sb_b + tl.program_id(0) * sb_h + t64 * sb_t, mask=tm, other=0.0).to(ACC)
        s = tl.where(tm, s, float("-inf"))
        tl.store(scores_ptr + row * T + t64, s, mask=tm)
        m_new = tl.maximum(m, tl.max(s, axis=0))
        # every score so far -inf: no rescaling (and no NaN from -inf - -inf)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        e = tl.exp(s - m_safe)
        l_sum = l_sum * alpha + tl.sum(e, axis=0)
        w = e
        if HAS_DROPOUT:
            kept = tl.load(keep_ptr + row * T + kc, mask=tm, other=0)
            w = tl.where(kept != 0, e * inv_keep, 0.0)
        vt = tl.load(v_ptr + b * sv_b + r[:, None] * sv_t + col[None, :], mask=tm[:, None] & dm[None, :],
                     other=0.0).to(ACC)
        acc = acc * alpha + tl.sum(w[:, None] * vt, axis=0)
        m = m_new
    # p_t = exp(s_t - m) / l: kept as (m, 1 / l), not as a log-sum-exp m + log(l), which loses log(l) beside
    # scores of HF's masking minimum (every key padded); every score -inf: p = 0, out = 0 (SDPA's math path)
    inv_l = tl.where(l_sum == 0.0, 0.0, 1.0 / tl.where(l_sum == 0.0, 1.0, l_sum))
    out = acc * inv_l
    tl.store(out_ptr + b * so_b + col, out.to(out_ptr.dtype.element_ty), mask=dm)
    tl.store(out_acc_ptr + row * D + d, out, mask=dm)
    tl.store(stats_ptr + 2 * row + tl.arange(0, 1), tl.where(m == float("-inf"), 0.0, m))
    tl.store(stats_ptr + 2 * row + 1 + tl.arange(0, 1), inv_l)


@triton.jit
def _first_row_backward_kernel(grad_ptr, q_ptr, k_ptr, v_ptr, keep_ptr, seq_ptr, keyrow_ptr, pos_ptr, out_acc_ptr,
                               scores_ptr, stats_ptr, dq_ptr, dk_ptr, dv_ptr, T, H, scale_hi, scale_lo, keep_hi,
                               keep_lo, sg_b, sq_b, sk_b, sk_t, sv_b, sv_t, sdq_b, sdk_b, sdk_t, sdv_b, sdv_t,
                               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                               HAS_DROPOUT: tl.constexpr, ACC: tl.constexpr, PACKED: tl.constexpr,
                               GATHERED: tl.constexpr):
    b, row, d, dm, col, q, scale, inv_keep = _program(q_ptr, sq_b, H, scale_hi, scale_lo, keep_hi, keep_lo, D,
                                                      BLOCK_D, ACC)
    do = tl.load(grad_ptr + b * sg_b + col, mask=dm, other=0.0).to(ACC)
    delta = tl.sum(tl.load(out_acc_ptr + row * D + d, mask=dm, other=0.0) * do, axis=0)
    m = tl.load(stats_ptr + 2 * row + tl.arange(0, 1))
    inv_l = tl.load(stats_ptr + 2 * row + 1 + tl.arange(0, 1))
    dq = tl.zeros([BLOCK_D], ACC)
    n = _key_count(seq_ptr, b, T, PACKED)
    for t0 in range(0, n, BLOCK_T):
        t, tm, r, kc = _key_tile(seq_ptr, keyrow_ptr, pos_ptr, b, t0, T, n, BLOCK_T, PACKED, GATHERED, HAS_DROPOUT)
        t64 = t.to(tl.int64)
        tile = tm[:, None] & dm[None, :]
        s = tl.load(scores_ptr + row * T + t64, mask=tm, other=float("-inf"))
        p = tl.exp(s - m) * inv_l
        vt = tl.load(v_ptr + b * sv_b + r[:, None] * sv_t + col[None, :], mask=tile, other=0.0).to(ACC)
        dp = tl.sum(vt * do[None, :], axis=1)
        pd = p
        if HAS_DROPOUT:
            kept = tl.load(keep_ptr + row * T + kc, mask=tm, other=0) != 0
            dp = tl.where(kept, dp * inv_keep, 0.0)
            pd = tl.where(kept, p * inv_keep, 0.0)
        ds = p * (dp - delta) * scale
        kt = tl.load(k_ptr + b * sk_b + r[:, None] * sk_t + col[None, :], mask=tile, other=0.0).to(ACC)
        dq += tl.sum(ds[:, None] * kt, axis=0)
        tl.store(dk_ptr + b * sdk_b + r[:, None] * sdk_t + col[None, :],
                 (ds[:, None] * q[None, :]).to(dk_ptr.dtype.element_ty), mask=tile)
        tl.store(dv_ptr + b * sdv_b + r[:, None] * sdv_t + col[None, :],
                 (pd[:, None] * do[None, :]).to(dv_ptr.dtype.element_ty), mask=tile)
    tl.store(dq_ptr + b * sdq_b + col, dq.to(dq_ptr.dtype.element_ty), mask=dm)


def _tiles(T, D):
    return min(pow2_at_least(T), BLOCK_T), pow2_at_least(D)


def _layout(q, k, rows):
    """``(B, T, H*D, the rows' pointers and flags)`` of padded keys ``[B, T, H*D]`` or, with `rows`, packed keys
    ``[N, H*D]`` (module docstring)."""
    if rows is None:
        B, T, HD = k.shape
        return B, T, HD, (q, q, q), dict(PACKED=False, GATHERED=False)
    seq, key_rows, positions, T = rows
    return (q.shape[0], T, k.shape[-1], (seq, key_rows if key_rows is not None else seq, positions),
            dict(PACKED=True, GATHERED=key_rows is not None))


def _strides(t, rows):
    """(sequence, row) strides of a key-shaped tensor: padded ``[B, T, H*D]``, or packed ``[N, H*D]`` rows
    addressed by their row alone (a sequence stride of 0)."""
    return (t.stride(0), t.stride(1)) if rows is None else (0, t.stride(-2))


def forward(q, k, v, bias, keep, heads: int, scale: float, inv_keep: float, rows=None):
    """``(out [B, 1, H*D] in q's dtype, saved)``; `saved` = (out_acc [B, H, D], scores [B, H, T], stats [B, H, 2]:
    the scores' maximum and the softmax's inverse denominator) at the accumulation precision, for `backward`.
    `bias`: None or ``[B, H or 1, T]`` (broadcast strides allowed); `keep`: None or a uint8 ``[B, H, T]`` contiguous
    tensor; `rows`: None (``k``, ``v`` padded ``[B, T, H*D]``) or the packed keys' ``(seq, key_rows, positions,
    T)`` (module docstring; no bias). Shapes and strides are checked by the caller (`cat_fast.layers.attention`)."""
    B, T, HD, pointers, flags = _layout(q, k, rows)
    D = HD // heads
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty(B, 1, HD, device=q.device, dtype=q.dtype)
    out_acc = torch.empty(B, heads, D, device=q.device, dtype=acc)
    scores = torch.empty(B, heads, T, device=q.device, dtype=acc)
    stats = torch.empty(B, heads, 2, device=q.device, dtype=acc)
    block_t, block_d = _tiles(T, D)
    sb = bias.stride() if bias is not None else (0, 0, 0)
    _first_row_forward_kernel[(heads, B)](
        q, k, v, bias if bias is not None else q, keep if keep is not None else q, *pointers, out, out_acc, scores,
        stats, T, heads, *split_scalar(scale), *split_scalar(inv_keep), q.stride(0), *_strides(k, rows),
        *_strides(v, rows), sb[0], sb[1], sb[2], out.stride(0),
        D=D, BLOCK_D=block_d, BLOCK_T=block_t, HAS_BIAS=bias is not None, HAS_DROPOUT=keep is not None,
        ACC=acc_tl_dtype(q), num_warps=NUM_WARPS, **flags)
    return out, (out_acc, scores, stats)


def backward(grad, q, k, v, keep, saved, heads: int, scale: float, inv_keep: float, dk=None, dv=None, rows=None):
    """``(dq [B, 1, H*D], dk, dv)`` in the inputs' dtypes. `dk` / `dv`: where to write the key and value gradients
    (shaped as ``k``, unit column stride, e.g. the halves of one ``[B, T, 2*H*D]`` gradient); new tensors where
    None (zeros with packed `rows`, whose unlisted rows the kernel does not write)."""
    out_acc, scores, stats = saved
    B, T, HD, pointers, flags = _layout(q, k, rows)
    D = HD // heads
    if grad.stride(-1) != 1:
        grad = grad.contiguous()
    dq = torch.empty(B, 1, HD, device=q.device, dtype=q.dtype)
    new = torch.empty if rows is None else torch.zeros
    dk = new(k.shape, device=k.device, dtype=k.dtype) if dk is None else dk
    dv = new(v.shape, device=v.device, dtype=v.dtype) if dv is None else dv
    block_t, block_d = _tiles(T, D)
    _first_row_backward_kernel[(heads, B)](
        grad, q, k, v, keep if keep is not None else q, *pointers, out_acc, scores, stats, dq, dk, dv, T, heads,
        *split_scalar(scale), *split_scalar(inv_keep),
        grad.stride(0), q.stride(0), *_strides(k, rows), *_strides(v, rows), dq.stride(0), *_strides(dk, rows),
        *_strides(dv, rows),
        D=D, BLOCK_D=block_d, BLOCK_T=block_t, HAS_DROPOUT=keep is not None, ACC=acc_tl_dtype(q),
        num_warps=NUM_WARPS, **flags)
    return dq, dk, dv
