"""Triton kernels of cmix (docs/KERNELS.md#cmix)."""
import torch
import triton
import triton.language as tl

from ..dtypes import acc_dtype
from ._common import acc_tl_dtype, pow2_at_least


@triton.jit
def _cmix_fwd_kernel(h_ptr, lam_ptr, partner_ptr, out_ptr, BT, T, D, lam_sb, lam_st,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    # grid: (row tiles over B*T, D blocks)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < BT
    r64 = r.to(tl.int64)
    i = r64 // T
    t = r64 - i * T
    pi = tl.load(partner_ptr + i, mask=rmask, other=0)
    lam = tl.load(lam_ptr + i * lam_sb + t * lam_st, mask=rmask, other=0.0).to(ACC)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m2 = rmask[:, None] & (cols < D)[None, :]
    own = r64 * D
    oth = (pi * T + t) * D
    a = tl.load(h_ptr + own[:, None] + cols[None, :], mask=m2, other=0.0).to(ACC)
    b = tl.load(h_ptr + oth[:, None] + cols[None, :], mask=m2, other=0.0).to(ACC)
    lam2 = lam[:, None]
    out = lam2 * b + (1.0 - lam2) * a
    tl.store(out_ptr + own[:, None] + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _cmix_bwd_kernel(grad_ptr, h_ptr, lam_ptr, partner_ptr, gh_ptr, glam_ptr, B, T, D,
                     lam_sb, lam_st, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
                     ACC: tl.constexpr):
    # grid: (B*T,). A program owns row (k, t) of grad_h and grad_lam[k, t]; it loops over D.
    r = tl.program_id(0).to(tl.int64)
    k = r // T
    t = r - k * T
    pk = tl.load(partner_ptr + k)
    lam_k = tl.load(lam_ptr + k * lam_sb + t * lam_st).to(ACC)
    own = r * D
    oth = (pk * T + t) * D
    bar = tl.arange(0, BLOCK_B)
    glam_vec = tl.zeros([BLOCK_D], ACC)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        cmask = cols < D
        g = tl.load(grad_ptr + own + cols, mask=cmask, other=0.0).to(ACC)
        hk = tl.load(h_ptr + own + cols, mask=cmask, other=0.0).to(ACC)
        hp = tl.load(h_ptr + oth + cols, mask=cmask, other=0.0).to(ACC)
        glam_vec += (hp - hk) * g
        acc = (1.0 - lam_k) * g
        # contributions of every sample i with partner[i] == k, in increasing i (deterministic)
        for b0 in range(0, B, BLOCK_B):
            bidx = b0 + bar
            pv = tl.load(partner_ptr + bidx, mask=bidx < B, other=-1)
            hit = pv == k
            cnt = tl.sum(hit.to(tl.int32), axis=0)
            prev = tl.min(bar, axis=0) - 1  # int32 scalar -1 (loop-carried type)
            for _j in range(0, cnt):
                j = tl.min(tl.where(hit & (bar > prev), bar, BLOCK_B), axis=0)
                i = (b0 + j).to(tl.int64)
                li = tl.load(lam_ptr + i * lam_sb + t * lam_st).to(ACC)
                gi = tl.load(grad_ptr + (i * T + t) * D + cols, mask=cmask, other=0.0).to(ACC)
                acc += li * gi
                prev = j
        tl.store(gh_ptr + own + cols, acc.to(gh_ptr.dtype.element_ty), mask=cmask)
    tl.store(glam_ptr + r, tl.sum(glam_vec, axis=0))


def _lam_strides(lam: torch.Tensor, T: int):
    # [B] lam: per sample (t stride 0); [B, T] lam: per token.
    if lam.dim() == 1:
        return 1, 0
    return T, 1


def cmix_forward(h: torch.Tensor, lam: torch.Tensor, partner: torch.Tensor) -> torch.Tensor:
    B, T, D = h.shape
    out = torch.empty_like(h)
    BT = B * T
    if BT == 0 or D == 0:
        return out
    lam_sb, lam_st = _lam_strides(lam, T)
    BLOCK_D = min(pow2_at_least(D), 2048)
    BLOCK_R = max(1, min(2048 // BLOCK_D, pow2_at_least(BT)))
    num_warps = 8 if BLOCK_R * BLOCK_D >= 2048 else 4
    grid = (triton.cdiv(BT, BLOCK_R), triton.cdiv(D, BLOCK_D))
    _cmix_fwd_kernel[grid](h, lam, partner, out, BT, T, D, lam_sb, lam_st,
                           BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, ACC=acc_tl_dtype(h),
                           num_warps=num_warps)
    return out


def cmix_backward(grad: torch.Tensor, h: torch.Tensor, lam: torch.Tensor, partner: torch.Tensor):
    B, T, D = h.shape
    grad_h = torch.empty_like(h)
    grad_lam = torch.empty((B, T), dtype=acc_dtype(h.dtype), device=h.device)
    BT = B * T
    if BT == 0:
        return grad_h, grad_lam
    lam_sb, lam_st = _lam_strides(lam, T)
    BLOCK_D = min(pow2_at_least(D), 1024)
    BLOCK_B = min(pow2_at_least(B), 128)
    num_warps = 4 if BLOCK_D >= 512 else (2 if BLOCK_D >= 128 else 1)
    _cmix_bwd_kernel[(BT,)](grad, h, lam, partner, grad_h, grad_lam, B, T, D, lam_sb, lam_st,
                            BLOCK_D=BLOCK_D, BLOCK_B=BLOCK_B, ACC=acc_tl_dtype(h),
                            num_warps=num_warps)
    return grad_h, grad_lam
