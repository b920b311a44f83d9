"""Triton kernels of crm_loss (docs/KERNELS.md#crm_loss). One launch per call each."""
import torch
import triton
import triton.language as tl

from ._common import acc_tl_dtype, acc_torch_dtype, row_softmax_stats, row_tiles, scalar_acc, split_scalar

_MAX_BLOCK_C = 2048
# single-program (mean/sum) forward: one SM does all rows, so use big tiles and many warps
_SINGLE_TILE = 16384
_SINGLE_WARPS = 16


@triton.jit
def _crm_fwd_kernel(logits_ptr, cf_ptr, labels_ptr, loss_ptr, stats_ptr, B, C,
                    a1_hi, a1_lo, a2_hi, a2_lo, REDUCTION: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    # REDUCTION 0: grid over row tiles, one tile each. 1/2: a single program loops over all tiles.
    a1 = scalar_acc(a1_hi, a1_lo, ACC)
    a2 = scalar_acc(a2_hi, a2_lo, ACC)
    if REDUCTION == 0:
        t_start = tl.program_id(0)
        t_end = t_start + 1
    else:
        t_start = 0
        t_end = tl.cdiv(B, BLOCK_R)
    total = tl.zeros([BLOCK_R], ACC)
    for tile in range(t_start, t_end):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < B
        m, s, _a = row_softmax_stats(logits_ptr, rows, rmask, C, BLOCK_R, BLOCK_C, ACC, False)
        mc, sc, _b = row_softmax_stats(cf_ptr, rows, rmask, C, BLOCK_R, BLOCK_C, ACC, False)
        y = tl.load(labels_ptr + rows, mask=rmask, other=0)
        zy = tl.load(logits_ptr + rows.to(tl.int64) * C + y, mask=rmask, other=0.0).to(ACC)
        phi = 1.0 / s
        phi_cf = 1.0 / sc
        w = tl.minimum(tl.maximum(phi / phi_cf, a1), a2)
        ce = m + tl.log(s) - zy
        l = w * ce
        sp = stats_ptr + rows.to(tl.int64) * 4
        tl.store(sp + 0, w, mask=rmask)
        tl.store(sp + 1, ce, mask=rmask)
        tl.store(sp + 2, phi, mask=rmask)
        tl.store(sp + 3, phi_cf, mask=rmask)
        if REDUCTION == 0:
            tl.store(loss_ptr + rows, l, mask=rmask)
        else:
            total += tl.where(rmask, l, 0.0)
    if REDUCTION != 0:
        tot = tl.sum(total, axis=0)
        if REDUCTION == 1:
            tot = tot / B
        tl.store(loss_ptr, tot)


@triton.jit
def _crm_bwd_kernel(grad_ptr, logits_ptr, cf_ptr, labels_ptr, stats_ptr, gl_ptr, gcf_ptr, B, C,
                    a1_hi, a1_lo, a2_hi, a2_lo, REDUCTION: tl.constexpr, DETACH: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < B
    r64 = rows.to(tl.int64)
    if REDUCTION == 0:
        go = tl.load(grad_ptr + rows, mask=rmask, other=0.0).to(ACC)
    else:
        go = tl.load(grad_ptr + rows * 0, mask=rmask, other=0.0).to(ACC)
        if REDUCTION == 1:
            go = go / B
    sp = stats_ptr + r64 * 4
    w = tl.load(sp + 0, mask=rmask, other=0.0).to(ACC)
    y = tl.load(labels_ptr + rows, mask=rmask, other=0)
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
        inside = (ratio > a1) & (ratio < a2)
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
        g = cw * (p - oy)
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
                     a1: float, a2: float, reduction: int, detach_weight: bool = False):
    # detach_weight does not change the forward (it only selects the backward; see docs/KERNELS.md)
    B, C = logits.shape
    acc = acc_torch_dtype(logits)
    reduction = int(reduction)
    if reduction == 0:
        loss = torch.empty((B,), dtype=acc, device=logits.device)
    elif reduction in (1, 2):
        loss = torch.empty((), dtype=acc, device=logits.device)
    else:
        raise ValueError(f"crm_loss_forward: reduction must be 0, 1 or 2, got {reduction}")
    stats = torch.empty((B, 4), dtype=acc, device=logits.device)
    if reduction == 0:
        if B == 0:
            return loss, stats
        BLOCK_R, BLOCK_C = row_tiles(B, C, _MAX_BLOCK_C, 2048, max_rows=64)
        grid = (triton.cdiv(B, BLOCK_R),)
    else:
        # one program loops over all rows: bigger row tiles, fewer serial steps
        BLOCK_R, BLOCK_C = row_tiles(B, C, _MAX_BLOCK_C * 2, _SINGLE_TILE, max_rows=512)
        grid = (1,)
    nw = 8 if BLOCK_R * BLOCK_C >= 2048 else 4
    if reduction != 0 and BLOCK_R * BLOCK_C >= 8192:
        nw = _SINGLE_WARPS
    _crm_fwd_kernel[grid](logits, cf_logits, labels, loss, stats, B, C,
                          *split_scalar(a1), *split_scalar(a2), REDUCTION=reduction,
                          BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, ACC=acc_tl_dtype(logits), num_warps=nw)
    return loss, stats


def crm_loss_backward(grad: torch.Tensor, logits: torch.Tensor, cf_logits: torch.Tensor,
                      labels: torch.Tensor, stats: torch.Tensor, a1: float, a2: float,
                      reduction: int, detach_weight: bool):
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
        *split_scalar(a1), *split_scalar(a2), REDUCTION=reduction, DETACH=bool(detach_weight),
        BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, ACC=acc_tl_dtype(logits), num_warps=nw)
    return grad_logits, grad_cf
