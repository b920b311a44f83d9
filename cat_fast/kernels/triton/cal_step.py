"""Triton kernel of cal_step_ (docs/KERNELS.md#cal_step_)."""
import torch
import triton
import triton.language as tl

from ._common import acc_tl_dtype, row_tiles, scalar_acc, split_scalar


@triton.jit
def _cal_step_kernel(lam_ptr, grad_ptr, NR, L, lr_hi, lr_lo, p_hi, p_lo, lo_hi, lo_lo, hi_hi, hi_lo,
                     BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr, ACC: tl.constexpr):
    # NR rows of length L (L = T for [B, T] lam, L = 1 for [B] lam); lam updated in place.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < NR
    roff = rows.to(tl.int64) * L
    lr = scalar_acc(lr_hi, lr_lo, ACC)
    p = scalar_acc(p_hi, p_lo, ACC)
    lo = scalar_acc(lo_hi, lo_lo, ACC)
    hi = scalar_acc(hi_hi, hi_lo, ACC)
    # pass 1: amax_i = max_t |lam_it| (scaling keeps the p-norm free of overflow/underflow)
    amax = tl.zeros([BLOCK_R], ACC)
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        m2 = rmask[:, None] & (cols < L)[None, :]
        x = tl.load(lam_ptr + roff[:, None] + cols[None, :], mask=m2, other=0.0).to(ACC)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    safe = tl.where(amax > 0, amax, 1.0)
    # pass 2: S_i = sum_t (|lam_it| / amax_i)^p, so n_i = amax_i * S_i^(1/p)
    S = tl.zeros([BLOCK_R], ACC)
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        m2 = rmask[:, None] & (cols < L)[None, :]
        x = tl.load(lam_ptr + roff[:, None] + cols[None, :], mask=m2, other=0.0).to(ACC)
        rr = tl.abs(x) / safe[:, None]
        pos = rr > 0
        S += tl.sum(tl.where(pos, tl.exp(p * tl.log(tl.where(pos, rr, 1.0))), 0.0), axis=1)
    S_safe = tl.where(S > 0, S, 1.0)
    root = tl.exp(tl.log(S_safe) / p)  # S^(1/p) (>= 1 when the row is not all zero)
    is_p1 = p == 1.0
    # pass 3: update
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        m2 = rmask[:, None] & (cols < L)[None, :]
        offs = roff[:, None] + cols[None, :]
        x = tl.load(lam_ptr + offs, mask=m2, other=0.0).to(ACC)
        g = tl.load(grad_ptr + offs, mask=m2, other=0.0).to(ACC)
        sg = tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))
        q = tl.abs(x) / safe[:, None] / root[:, None]  # |lam| / n
        pos = q > 0
        powq = tl.exp((p - 1.0) * tl.log(tl.where(pos, q, 1.0)))
        dn = tl.where(is_p1, sg, tl.where(pos, sg * powq, 0.0))
        new = x + lr * (g - dn)
        # NaN stays NaN (torch.clamp, the reference and the CUDA kernel): a NaN gradient must not set lambda to lo
        new = tl.minimum(tl.maximum(new, lo, propagate_nan=tl.PropagateNan.ALL), hi, propagate_nan=tl.PropagateNan.ALL)
        tl.store(lam_ptr + offs, new.to(lam_ptr.dtype.element_ty), mask=m2)


def cal_step_(lam: torch.Tensor, grad: torch.Tensor, lr: float, p: float, lo: float, hi: float) -> None:
    """Updates lam in place; returns nothing (schema `-> ()`)."""
    if lam.dim() == 1:
        NR, L = lam.shape[0], 1
    else:
        NR, L = lam.shape
    if NR == 0 or L == 0:
        return None
    BLOCK_R, BLOCK_L = row_tiles(NR, L, 1024, 1024, max_rows=1024)
    nw = 4
    _cal_step_kernel[(triton.cdiv(NR, BLOCK_R),)](
        lam, grad, NR, L, *split_scalar(lr), *split_scalar(p), *split_scalar(lo), *split_scalar(hi),
        BLOCK_R=BLOCK_R, BLOCK_L=BLOCK_L, ACC=acc_tl_dtype(lam), num_warps=nw)
    return None
