"""Triton kernels of bias_loss (docs/KERNELS.md#bias_loss): the bias-model losses of docs/METHODS.md §4, `kind`
0 PoE, 1-4 reweighting, 5 learned-mixin +H, 6 confidence regularisation. One launch per call each.

Rows whose label == ignore_index: loss 0, denominator term 0, zero gradients. The forward reduces like crm_loss
(per-program float64 partials, the last program to finish adds them in a fixed order) for every reduction, since
denom = Σ d_i is always returned; the mean backward reads denom[0] on the device."""
import torch
import triton
import triton.language as tl

from ..dtypes import acc_dtype
from ._common import (
    acc_tl_dtype,
    completion_counter,
    finish_partials,
    labelled_rows,
    online_softmax,
    row_tiles,
    scalar_acc,
    split_scalar,
)

KINDS = 7
# the kinds whose `aux` is read (numbers of `cat_fast.ops.BiasLoss`; the kernels' KIND == 5 / 6 branches)
LEARNED_MIXIN, CONF_REG = 5, 6  # aux: the gate [B]; the teacher's probabilities [B, C]
_MAX_BLOCK_C = 2048
# reduction none and the backward: small tiles, one per program (backward) or a few (forward, see _MAX_PROGRAMS)
_TILE = 2048
# mean/sum forward: bigger tiles and more warps (a program may loop over several tiles)
_SUM_TILE = 8192
# forward: most programs (partial sums); a power of two (the last program loads them as one block)
_MAX_PROGRAMS = 1024


@triton.jit
def _softplus(x):
    """torch's softplus (beta 1, threshold 20): x above 20, else log1p(exp(x)) (log1p written out: Goldberg)."""
    u = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + u
    return tl.where(x > 20.0, x, tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0))))


@triton.jit
def _softplus_grad(x):
    """torch's softplus derivative: 1 above the threshold 20, else exp(x) / (exp(x) + 1)."""
    z = tl.exp(tl.minimum(x, 20.0))
    return tl.where(x > 20.0, 1.0, z / (z + 1.0))


@triton.jit
def _pow(t, e):
    """t ** e like torch.pow for t >= 0: exp(e log t), with 0 ** e = 0 (e > 0), inf (e < 0) and x ** 0 = 1."""
    p = tl.exp(e * tl.log(t))
    p = tl.where(t == 0.0, tl.where(e > 0.0, 0.0, float("inf")), p)
    return tl.where(e == 0.0, 1.0, p)


@triton.jit
def _reweight(by, KIND: tl.constexpr):
    """The reweighting kinds' weight of a row: 1 - p_b(y) (kinds 1, 3) or 1 / p_b(y) (kinds 2, 4)."""
    pb = tl.exp(by)
    if KIND == 1 or KIND == 3:
        w = 1.0 - pb
    else:
        w = 1.0 / pb
    return w


@triton.jit
def _row_terms(bias_ptr, aux_ptr, rows, rmask, keep, yc, roff, KIND: tl.constexpr, ACC: tl.constexpr):
    """Per row: by = b_y (0 where not kept); kind 5 the gate and sp = softplus(gate); kind 6 the teacher's exponent
    e = 1 - p_b(y) (zeros where a kind does not use them)."""
    by = tl.load(bias_ptr + roff + yc, mask=keep, other=0.0).to(ACC)
    gate = tl.zeros_like(by)
    sp = gate
    e = gate
    if KIND == 5:
        gate = tl.load(aux_ptr + rows, mask=rmask, other=0.0).to(ACC)
        sp = _softplus(gate)
    if KIND == 6:
        e = 1.0 - tl.exp(by)
    return by, gate, sp, e


@triton.jit
def _chunk(logits_ptr, bias_ptr, roff, rmask, c0, C, sp, KIND: tl.constexpr, BLOCK_C: tl.constexpr,
           ACC: tl.constexpr):
    """Columns c0 .. c0 + BLOCK_C of the row tile: cols, cmask, m2 (the load mask), offs, and x = z (kind 0: + b;
    kind 5: + a, a = sp b) with a and b (kind 5; zeros otherwise)."""
    cols = c0 + tl.arange(0, BLOCK_C)
    cmask = cols < C
    m2 = rmask[:, None] & cmask[None, :]
    offs = roff[:, None] + cols[None, :]
    x = tl.load(logits_ptr + offs, mask=m2, other=0.0).to(ACC)
    a = tl.zeros_like(x)
    b = a
    if KIND == 0:
        x += tl.load(bias_ptr + offs, mask=m2, other=0.0).to(ACC)
    if KIND == 5:
        b = tl.load(bias_ptr + offs, mask=m2, other=0.0).to(ACC)
        a = sp[:, None] * b  # 0 on masked lanes
        x += a
    return cols, cmask, m2, offs, x, a, b


@triton.jit
def _row_stats(logits_ptr, bias_ptr, aux_ptr, rmask, roff, sp, e, C, KIND: tl.constexpr, WITH_TZ: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    """The first pass over the columns: of x (see _chunk) the max m and s = Σ exp(x - m); kind 5 also of a the max
    ma, sa = Σ exp(a - ma) and ua = Σ exp(a - ma) a; kind 6 tsum = Σ t^e and (WITH_TZ) tz = Σ t^e x."""
    m = tl.full([BLOCK_R], float("-inf"), ACC)
    s = tl.zeros([BLOCK_R], ACC)
    ma = tl.full([BLOCK_R], float("-inf"), ACC)
    sa = tl.zeros([BLOCK_R], ACC)
    ua = tl.zeros([BLOCK_R], ACC)
    tsum = tl.zeros([BLOCK_R], ACC)
    tz = tl.zeros([BLOCK_R], ACC)
    for c0 in range(0, C, BLOCK_C):
        cols, cmask, m2, offs, x, a, _b = _chunk(logits_ptr, bias_ptr, roff, rmask, c0, C, sp, KIND, BLOCK_C, ACC)
        if KIND == 5:
            a_inf = tl.where(cmask[None, :], a, float("-inf"))
            nma = tl.maximum(ma, tl.max(a_inf, axis=1))  # finite: every chunk has a column, b finite
            scale = tl.exp(ma - nma)
            ea = tl.exp(a_inf - nma[:, None])
            sa = sa * scale + tl.sum(ea, axis=1)
            ua = ua * scale + tl.sum(ea * a, axis=1)
            ma = nma
        if KIND == 6:
            t = tl.load(aux_ptr + offs, mask=m2, other=0.0).to(ACC)
            te = tl.where(m2, _pow(t, e[:, None]), 0.0)
            tsum += tl.sum(te, axis=1)
            if WITH_TZ:
                tz += tl.sum(te * x, axis=1)
        m, s = online_softmax(m, s, tl.where(cmask[None, :], x, float("-inf")))
    return m, s, ma, sa, ua, tsum, tz


@triton.jit
def _bias_fwd_kernel(logits_ptr, bias_ptr, labels_ptr, aux_ptr, loss_ptr, denom_ptr, part_ptr, count_ptr, B, C,
                     TILES, ew_hi, ew_lo, ignore_index, KIND: tl.constexpr, REDUCTION: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    # Each program handles TILES consecutive row tiles: it writes the row losses (reduction none) or sums them
    # into one partial, and sums the denominator terms d into a second partial; finish_partials adds them (the
    # program that finishes last, in a fixed order) and writes denom (and the mean / sum loss).
    ew = scalar_acc(ew_hi, ew_lo, ACC)
    pid = tl.program_id(0)
    t_start = pid * TILES
    t_end = tl.minimum(t_start + TILES, tl.cdiv(B, BLOCK_R))
    total = tl.zeros([BLOCK_R], ACC)
    dsum = tl.zeros([BLOCK_R], ACC)
    for tile in range(t_start, t_end):
        rows, rmask, keep, yc, roff = labelled_rows(labels_ptr, tile, B, C, ignore_index, BLOCK_R)
        zy = tl.load(logits_ptr + roff + yc, mask=keep, other=0.0).to(ACC)
        by, _gate, sp, e = _row_terms(bias_ptr, aux_ptr, rows, rmask, keep, yc, roff, KIND, ACC)
        m, s, ma, sa, ua, tsum, tz = _row_stats(logits_ptr, bias_ptr, aux_ptr, rmask, roff, sp, e, C, KIND, True,
                                                BLOCK_R, BLOCK_C, ACC)
        # lse(x) - x_y as (m - x_y) + log(s): exact difference first (small losses keep their digits)
        log_s = tl.log(s)
        d = tl.full([BLOCK_R], 1.0, ACC)
        if KIND == 0:
            l = (m - (zy + by)) + log_s
        if KIND == 1 or KIND == 2 or KIND == 3 or KIND == 4:
            w = _reweight(by, KIND)
            l = w * ((m - zy) + log_s)
            if KIND == 1 or KIND == 2:
                d = w
        if KIND == 5:
            h = (ma - ua / sa) + tl.log(sa)
            l = ((m - (zy + sp * by)) + log_s) + ew * h
        if KIND == 6:
            l = (m - tz / tsum) + log_s
        l = tl.where(keep, l, 0.0)
        d = tl.where(keep, d, 0.0)
        if REDUCTION == 0:
            tl.store(loss_ptr + rows, l.to(loss_ptr.dtype.element_ty), mask=rmask)
        else:
            total += l
        dsum += d
    finish_partials(part_ptr, count_ptr, loss_ptr, denom_ptr, tl.sum(total, axis=0).to(tl.float64),
                    tl.sum(dsum, axis=0).to(tl.float64), REDUCTION, True, BLOCK_P)


@triton.jit
def _bias_bwd_kernel(grad_ptr, logits_ptr, bias_ptr, labels_ptr, aux_ptr, denom_ptr, gl_ptr, ga_ptr, B, C,
                     ew_hi, ew_lo, ignore_index, KIND: tl.constexpr, REDUCTION: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    # Two passes over the columns: the row statistics (as in the forward), then the gradient row (and, kind 5,
    # the gate's gradient sum).
    ew = scalar_acc(ew_hi, ew_lo, ACC)
    rows, rmask, keep, yc, roff = labelled_rows(labels_ptr, tl.program_id(0), B, C, ignore_index, BLOCK_R)
    if REDUCTION == 0:
        go = tl.load(grad_ptr + rows, mask=rmask, other=0.0).to(ACC)
    else:
        go = tl.load(grad_ptr + rows * 0, mask=rmask, other=0.0).to(ACC)
        if REDUCTION == 1:  # mean: grad / Σ d, read on the device
            go = go / tl.load(denom_ptr + rows * 0, mask=rmask, other=1.0).to(ACC)
    go = tl.where(keep, go, 0.0)
    by, gate, sp, e = _row_terms(bias_ptr, aux_ptr, rows, rmask, keep, yc, roff, KIND, ACC)
    coef = go
    if KIND == 1 or KIND == 2 or KIND == 3 or KIND == 4:
        coef = go * _reweight(by, KIND)
    m, s, ma, sa, ua, tsum, _tz = _row_stats(logits_ptr, bias_ptr, aux_ptr, rmask, roff, sp, e, C, KIND, False,
                                             BLOCK_R, BLOCK_C, ACC)
    inv_s = 1.0 / s
    if KIND == 5:
        lse_a = ma + tl.log(sa)
        h = (ma - ua / sa) + tl.log(sa)  # H(a)
        inv_sa = 1.0 / sa
        gsum = tl.zeros([BLOCK_R], ACC)
    if KIND == 6:
        inv_t = 1.0 / tsum
    for c0 in range(0, C, BLOCK_C):
        cols, cmask, m2, offs, x, a, b = _chunk(logits_ptr, bias_ptr, roff, rmask, c0, C, sp, KIND, BLOCK_C, ACC)
        p = tl.exp(tl.where(cmask[None, :], x, float("-inf")) - m[:, None]) * inv_s[:, None]
        oy = tl.where(cols[None, :] == yc[:, None], 1.0, 0.0)
        if KIND == 6:
            t = tl.load(aux_ptr + offs, mask=m2, other=0.0).to(ACC)
            g = go[:, None] * (p - _pow(t, e[:, None]) * inv_t[:, None])
        else:
            g = coef[:, None] * (p - oy)
        g = tl.where(keep[:, None], g, 0.0)
        tl.store(gl_ptr + offs, g.to(gl_ptr.dtype.element_ty), mask=m2)
        if KIND == 5:
            # r_c (log r_c + H(a)) with log r_c = a_c - lse(a); masked lanes: r = 0, b = 0
            r = tl.exp(tl.where(cmask[None, :], a, float("-inf")) - ma[:, None]) * inv_sa[:, None]
            term = b * (p - oy - ew * (r * ((a - lse_a[:, None]) + h[:, None])))
            gsum += tl.sum(tl.where(m2, term, 0.0), axis=1)
    if KIND == 5:
        ga = tl.where(keep, go * _softplus_grad(gate) * gsum, 0.0)
        tl.store(ga_ptr + rows, ga.to(ga_ptr.dtype.element_ty), mask=rmask)


def _check(kind, reduction, name):
    kind, reduction = int(kind), int(reduction)
    if not 0 <= kind < KINDS:
        raise ValueError(f"{name}: kind must be in [0, {KINDS}), got {kind}")
    if reduction not in (0, 1, 2):
        raise ValueError(f"{name}: reduction must be 0, 1 or 2, got {reduction}")
    return kind, reduction


def _warps(block_r, block_c):
    elems = block_r * block_c
    return 16 if elems >= 8192 else 8 if elems >= 2048 else 4


def bias_loss_forward(logits: torch.Tensor, bias: torch.Tensor, labels: torch.Tensor, aux: torch.Tensor,
                      kind: int, reduction: int, entropy_weight: float, ignore_index: int = -100):
    kind, reduction = _check(kind, reduction, "bias_loss_forward")
    logits, bias, labels = logits.contiguous(), bias.contiguous(), labels.contiguous()
    # other kinds: aux is not read (an empty aux may be a null pointer)
    aux = aux.contiguous() if kind in (LEARNED_MIXIN, CONF_REG) else bias
    B, C = logits.shape
    acc = acc_dtype(logits.dtype)
    device = logits.device
    loss = torch.empty((B,) if reduction == 0 else (), dtype=acc, device=device)
    denom = torch.empty((), dtype=acc, device=device)
    if reduction == 0:
        BLOCK_R, BLOCK_C = row_tiles(B, C, _MAX_BLOCK_C, _TILE, max_rows=64)
    else:
        BLOCK_R, BLOCK_C = row_tiles(B, C, _MAX_BLOCK_C, _SUM_TILE, max_rows=512)
    max_programs = _MAX_PROGRAMS
    n_tiles = max(1, triton.cdiv(B, BLOCK_R))  # B = 0: one program, it writes denom 0 (and the mean NaN)
    tiles = triton.cdiv(n_tiles, max_programs)
    grid = (triton.cdiv(n_tiles, tiles),)
    parts = torch.empty(2 * grid[0], dtype=torch.float64, device=device)  # loss sums, then denominator sums
    counter = completion_counter(device)
    _bias_fwd_kernel[grid](logits, bias, labels, aux, loss, denom, parts, counter, B, C, tiles,
                           *split_scalar(entropy_weight), ignore_index, KIND=kind, REDUCTION=reduction,
                           BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, BLOCK_P=max_programs, ACC=acc_tl_dtype(logits),
                           num_warps=_warps(BLOCK_R, BLOCK_C))
    return loss, denom


def bias_loss_backward(grad: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor, labels: torch.Tensor,
                       aux: torch.Tensor, denom: torch.Tensor, kind: int, reduction: int, entropy_weight: float,
                       ignore_index: int = -100):
    kind, reduction = _check(kind, reduction, "bias_loss_backward")
    grad, logits, bias, labels = grad.contiguous(), logits.contiguous(), bias.contiguous(), labels.contiguous()
    aux = aux.contiguous() if kind in (LEARNED_MIXIN, CONF_REG) else bias
    B, C = logits.shape
    acc = acc_dtype(logits.dtype)
    grad_logits = torch.empty((B, C), dtype=logits.dtype, device=logits.device)
    grad_aux = torch.empty((B,) if kind == LEARNED_MIXIN else (0,), dtype=acc, device=logits.device)
    if B == 0:
        return grad_logits, grad_aux
    BLOCK_R, BLOCK_C = row_tiles(B, C, _MAX_BLOCK_C, _TILE, max_rows=64)
    _bias_bwd_kernel[(triton.cdiv(B, BLOCK_R),)](
        grad, logits, bias, labels, aux, denom, grad_logits, grad_aux if kind == LEARNED_MIXIN else grad_logits, B, C,
        *split_scalar(entropy_weight), ignore_index, KIND=kind, REDUCTION=reduction,
        BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, ACC=acc_tl_dtype(logits), num_warps=_warps(BLOCK_R, BLOCK_C))
    return grad_logits, grad_aux
