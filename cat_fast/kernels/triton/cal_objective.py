"""Triton kernels of cal_objective (docs/KERNELS.md#cal_objective). Rows whose label == ignore_index: 0 / zero gradient;
Phi's subgradient goes to the first index of the row maximum (row_softmax_stats)."""
import torch
import triton
import triton.language as tl

from ..dtypes import acc_dtype
from ._common import acc_tl_dtype, labelled_rows, row_softmax_stats, row_tiles, scalar_acc, split_scalar

_MAX_BLOCK_C = 2048
_TILE = 2048


@triton.jit
def _cal_obj_fwd_kernel(logits_ptr, labels_ptr, out_ptr, B, C, g_hi, g_lo, e_hi, e_lo, ignore_index,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    rows, rmask, keep, yc, roff = labelled_rows(labels_ptr, tl.program_id(0), B, C, ignore_index, BLOCK_R)
    m, s, _am = row_softmax_stats(logits_ptr, rows, rmask, C, BLOCK_R, BLOCK_C, ACC, False)
    zy = tl.load(logits_ptr + roff + yc, mask=keep, other=0.0).to(ACC)
    gamma = scalar_acc(g_hi, g_lo, ACC)
    eta = scalar_acc(e_hi, e_lo, ACC)
    # max softmax = exp(m - lse) = 1 / s
    val = tl.where(keep, gamma * (m + tl.log(s) - zy) + eta / s, 0.0)
    tl.store(out_ptr + rows, val.to(out_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _cal_obj_bwd_kernel(grad_ptr, logits_ptr, labels_ptr, out_ptr, B, C, g_hi, g_lo, e_hi, e_lo, ignore_index,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    rows, rmask, keep, yc, roff = labelled_rows(labels_ptr, tl.program_id(0), B, C, ignore_index, BLOCK_R)
    m, s, am = row_softmax_stats(logits_ptr, rows, rmask, C, BLOCK_R, BLOCK_C, ACC, True)
    gamma = scalar_acc(g_hi, g_lo, ACC)
    eta = scalar_acc(e_hi, e_lo, ACC)
    go = tl.where(keep, tl.load(grad_ptr + rows, mask=rmask, other=0.0).to(ACC), 0.0)
    inv_s = 1.0 / s
    cg = (go * gamma)[:, None]
    ce = (go * eta * inv_s)[:, None]  # go * eta * pmax
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m2 = rmask[:, None] & (cols < C)[None, :]
        x = tl.load(logits_ptr + roff[:, None] + cols[None, :], mask=m2, other=0.0).to(ACC)
        p = tl.exp(x - m[:, None]) * inv_s[:, None]
        oy = tl.where(cols[None, :] == yc[:, None], 1.0, 0.0)
        oa = tl.where(cols[None, :] == am[:, None], 1.0, 0.0)
        g = tl.where(keep[:, None], cg * (p - oy) + ce * (oa - p), 0.0)
        tl.store(out_ptr + roff[:, None] + cols[None, :], g.to(out_ptr.dtype.element_ty), mask=m2)


def _launch(kernel, out, logits, tensors, gamma, eta, ignore_index):
    """Launch `kernel(*tensors, out, B, C, gamma, eta, ignore_index)` over the row tiles of logits [B, C]; return out."""
    B, C = logits.shape
    if B == 0:
        return out
    BLOCK_R, BLOCK_C = row_tiles(B, C, _MAX_BLOCK_C, _TILE, max_rows=64)
    g_hi, g_lo = split_scalar(gamma)
    e_hi, e_lo = split_scalar(eta)
    kernel[(triton.cdiv(B, BLOCK_R),)](
        *tensors, out, B, C, g_hi, g_lo, e_hi, e_lo, ignore_index,
        BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, ACC=acc_tl_dtype(logits), num_warps=8 if BLOCK_R * BLOCK_C >= 2048 else 4)
    return out


def cal_objective_forward(logits: torch.Tensor, labels: torch.Tensor, gamma: float, eta: float,
                          ignore_index: int = -100):
    out = torch.empty(logits.shape[:1], dtype=acc_dtype(logits.dtype), device=logits.device)
    return _launch(_cal_obj_fwd_kernel, out, logits, (logits, labels), gamma, eta, ignore_index)


def cal_objective_backward(grad: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                           gamma: float, eta: float, ignore_index: int = -100):
    return _launch(_cal_obj_bwd_kernel, torch.empty_like(logits), logits, (grad, logits, labels), gamma, eta,
                   ignore_index)
