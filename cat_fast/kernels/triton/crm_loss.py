"""Triton kernels of crm_loss (docs/KERNELS.md#crm_loss). One launch per call each.

Rows whose label == ignore_index: loss 0 (ce 0 in stats), zero gradients, not counted by the mean. Phi's subgradient
goes to the first index of the row maximum (row_softmax_stats)."""
import torch
import triton
import triton.language as tl

from ..dtypes import acc_dtype
from ._common import (
    acc_tl_dtype,
    completion_counter,
    finish_partials,
    row_softmax_stats,
    row_tiles,
    scalar_acc,
    split_scalar,
)

_MAX_BLOCK_C = 2048
# mean/sum forward: big tiles and many warps (a program may loop over several tiles)
_SINGLE_TILE = 16384
_SINGLE_WARPS = 16
# mean/sum forward: most programs (partial sums); a power of two (the last program loads them as one block)
_MAX_PROGRAMS = 1024

# labels read per step when a mean backward counts the non-ignored rows
_BLOCK_LABELS = 1024

@triton.jit
def _crm_fwd_kernel(logits_ptr, cf_ptr, labels_ptr, loss_ptr, stats_ptr, part_ptr, count_ptr, B, C, TILES,
                    a1_hi, a1_lo, a2_hi, a2_lo, ignore_index, REDUCTION: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    # REDUCTION 0: grid over row tiles, one tile each. 1/2: each program sums the losses of TILES
    # consecutive tiles into one partial and counts their non-ignored rows (a second partial); finish_partials
    # adds them (the program that finishes last, in a fixed order) and writes the loss (mean: sum / count).
    a1 = scalar_acc(a1_hi, a1_lo, ACC)
    a2 = scalar_acc(a2_hi, a2_lo, ACC)
    pid = tl.program_id(0)
    if REDUCTION == 0:
        t_start = pid
        t_end = pid + 1
    else:
        t_start = pid * TILES
        t_end = tl.minimum(t_start + TILES, tl.cdiv(B, BLOCK_R))
    total = tl.zeros([BLOCK_R], ACC)
    kept = tl.zeros([BLOCK_R], tl.int32)
    for tile in range(t_start, t_end):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < B
        m, s, _a = row_softmax_stats(logits_ptr, rows, rmask, C, BLOCK_R, BLOCK_C, ACC, False)
        mc, sc, _b = row_softmax_stats(cf_ptr, rows, rmask, C, BLOCK_R, BLOCK_C, ACC, False)
        y = tl.load(labels_ptr + rows, mask=rmask, other=0)
        keep = y != ignore_index
        zy = tl.load(logits_ptr + rows.to(tl.int64) * C + y, mask=rmask & keep, other=0.0).to(ACC)
        phi = 1.0 / s
        phi_cf = 1.0 / sc
        # NaN stays NaN (torch.clamp, the reference and the CUDA kernel): a NaN counterfactual must not give weight a1
        w = tl.minimum(tl.maximum(phi / phi_cf, a1, propagate_nan=tl.PropagateNan.ALL), a2,
                       propagate_nan=tl.PropagateNan.ALL)
        ce = tl.where(keep, m + tl.log(s) - zy, 0.0)
        l = tl.where(keep, w * ce, 0.0)
        sp = stats_ptr + rows.to(tl.int64) * 4
        tl.store(sp + 0, w, mask=rmask)
        tl.store(sp + 1, ce, mask=rmask)
        tl.store(sp + 2, phi, mask=rmask)
        tl.store(sp + 3, phi_cf, mask=rmask)
        if REDUCTION == 0:
            tl.store(loss_ptr + rows, l, mask=rmask)
        else:
            total += tl.where(rmask, l, 0.0)
            kept += (rmask & keep).to(tl.int32)
    if REDUCTION != 0:  # mean: sum / number of non-ignored rows (0 of them: NaN)
        finish_partials(part_ptr, count_ptr, loss_ptr, loss_ptr, tl.sum(total, axis=0).to(tl.float64),
                        tl.sum(kept, axis=0).to(tl.float64), REDUCTION, False, BLOCK_P)


@triton.jit
def _crm_bwd_kernel(grad_ptr, logits_ptr, cf_ptr, labels_ptr, stats_ptr, gl_ptr, gcf_ptr, B, C,
                    a1_hi, a1_lo, a2_hi, a2_lo, ignore_index, REDUCTION: tl.constexpr, DETACH: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_L: tl.constexpr, ACC: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < B
    r64 = rows.to(tl.int64)
    y = tl.load(labels_ptr + rows, mask=rmask, other=0)
    keep = y != ignore_index
    if REDUCTION == 0:
        go = tl.load(grad_ptr + rows, mask=rmask, other=0.0).to(ACC)
    else:
        go = tl.load(grad_ptr + rows * 0, mask=rmask, other=0.0).to(ACC)
        if REDUCTION == 1:  # divide by the number of non-ignored rows: every program counts them (B label reads)
            kept = tl.zeros([BLOCK_L], tl.int32)
            for l0 in range(0, B, BLOCK_L):
                offs = l0 + tl.arange(0, BLOCK_L)
                yl = tl.load(labels_ptr + offs, mask=offs < B, other=ignore_index)
                kept += (yl != ignore_index).to(tl.int32)
            go = go / tl.sum(kept, axis=0).to(ACC)
    go = tl.where(keep, go, 0.0)
    sp = stats_ptr + r64 * 4
    w = tl.load(sp + 0, mask=rmask, other=0.0).to(ACC)
    m, s, am = row_softmax_stats(logits_ptr, rows, rmask, C, BLOCK_R, BLOCK_C, ACC, True)
    inv_s = 1.0 / s
    cw = (go * w)[:, None]
    if not DETACH:
        a1 = scalar_acc(a1_hi, a1_lo, ACC)
        a2 = scalar_acc(a2_hi, a2_lo, ACC)
        ce = tl.load(sp + 1, mask=rmask, other=0.0).to(ACC)
        phi = tl.load(sp + 2, mask=rmask, other=1.0).to(ACC)
        phi_cf = tl.load(sp + 3, mask=rmask, other=1.0).to(ACC)
        mc, sc, amc = row_softmax_stats(cf_ptr, rows, rmask, C, BLOCK_R, BLOCK_C, ACC, True)
        inv_sc = 1.0 / sc
        ratio = phi / phi_cf
        inside = (ratio > a1) & (ratio < a2) & keep
        # d l / d phi = go*ce/phi_cf ; d l / d phi_cf = -go*ce*phi/phi_cf^2 (inside the interval only)
        cphi = tl.where(inside, go * ce / phi_cf * phi, 0.0)[:, None]
        ccf = tl.where(inside, -go * ce * phi / phi_cf, 0.0)[:, None]
    roff = r64 * C
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m2 = rmask[:, None] & (cols < C)[None, :]
        offs = roff[:, None] + cols[None, :]
        x = tl.load(logits_ptr + offs, mask=m2, other=0.0).to(ACC)
        p = tl.exp(x - m[:, None]) * inv_s[:, None]
        oy = tl.where(cols[None, :] == y[:, None], 1.0, 0.0)
        g = tl.where(keep[:, None], cw * (p - oy), 0.0)
        if DETACH:
            gc = tl.zeros([BLOCK_R, BLOCK_C], ACC)
        else:
            oa = tl.where(cols[None, :] == am[:, None], 1.0, 0.0)
            g += cphi * (oa - p)
            xc = tl.load(cf_ptr + offs, mask=m2, other=0.0).to(ACC)
            pc = tl.exp(xc - mc[:, None]) * inv_sc[:, None]
            oac = tl.where(cols[None, :] == amc[:, None], 1.0, 0.0)
            gc = ccf * (oac - pc)
        tl.store(gl_ptr + offs, g.to(gl_ptr.dtype.element_ty), mask=m2)
        tl.store(gcf_ptr + offs, gc.to(gcf_ptr.dtype.element_ty), mask=m2)


def crm_loss_forward(logits: torch.Tensor, cf_logits: torch.Tensor, labels: torch.Tensor,
                     a1: float, a2: float, reduction: int, detach_weight: bool = False, ignore_index: int = -100):
    # detach_weight does not change the forward (it only selects the backward; see docs/KERNELS.md)
    B, C = logits.shape
    acc = acc_dtype(logits.dtype)
    reduction = int(reduction)
    if reduction == 0:
        loss = torch.empty((B,), dtype=acc, device=logits.device)
    elif reduction in (1, 2):
        loss = torch.empty((), dtype=acc, device=logits.device)
    else:
        raise ValueError(f"crm_loss_forward: reduction must be 0, 1 or 2, got {reduction}")
    stats = torch.empty((B, 4), dtype=acc, device=logits.device)
    parts = counter = loss  # placeholders, unused by reduction none
    tiles = 1
    if reduction == 0:
        if B == 0:
            return loss, stats
        BLOCK_R, BLOCK_C = row_tiles(B, C, _MAX_BLOCK_C, 2048, max_rows=64)
        grid = (triton.cdiv(B, BLOCK_R),)
    else:
        BLOCK_R, BLOCK_C = row_tiles(B, C, _MAX_BLOCK_C * 2, _SINGLE_TILE, max_rows=512)
        n_tiles = max(1, triton.cdiv(B, BLOCK_R))
        tiles = triton.cdiv(n_tiles, _MAX_PROGRAMS)
        grid = (triton.cdiv(n_tiles, tiles),)
        parts = torch.empty(2 * grid[0], dtype=torch.float64, device=logits.device)  # sums, then row counts
        counter = completion_counter(logits.device)
    nw = 8 if BLOCK_R * BLOCK_C >= 2048 else 4
    if reduction != 0 and BLOCK_R * BLOCK_C >= 8192:
        nw = _SINGLE_WARPS
    _crm_fwd_kernel[grid](logits, cf_logits, labels, loss, stats, parts, counter, B, C, tiles,
                          *split_scalar(a1), *split_scalar(a2), ignore_index, REDUCTION=reduction,
                          BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, BLOCK_P=_MAX_PROGRAMS, ACC=acc_tl_dtype(logits),
                          num_warps=nw)
    return loss, stats


def crm_loss_backward(grad: torch.Tensor, logits: torch.Tensor, cf_logits: torch.Tensor,
                      labels: torch.Tensor, stats: torch.Tensor, a1: float, a2: float,
                      reduction: int, detach_weight: bool, ignore_index: int = -100):
    B, C = logits.shape
    grad_logits = torch.empty_like(logits)
    grad_cf = torch.empty_like(cf_logits)
    if B == 0:
        return grad_logits, grad_cf
    reduction = int(reduction)
    BLOCK_R, BLOCK_C = row_tiles(B, C, _MAX_BLOCK_C, 2048, max_rows=64)
    nw = 8 if BLOCK_R * BLOCK_C >= 2048 else 4
    _crm_bwd_kernel[(triton.cdiv(B, BLOCK_R),)](
        grad, logits, cf_logits, labels, stats, grad_logits, grad_cf, B, C,
        *split_scalar(a1), *split_scalar(a2), ignore_index, REDUCTION=reduction, DETACH=bool(detach_weight),
        BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, BLOCK_L=_BLOCK_LABELS, ACC=acc_tl_dtype(logits), num_warps=nw)
    return grad_logits, grad_cf
