"""Triton kernels of the gs_cosine_loss primitives (docs/KERNELS.md#gs_cosine_loss-primitives)."""
import torch
import triton
import triton.language as tl

from ..dtypes import acc_dtype
from ._common import acc_tl_dtype, row_dots, row_tiles


@triton.jit
def _gs_row_dots_kernel(x_ptr, y_ptr, out_ptr, N, K,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    roff = rows.to(tl.int64) * K
    xy, xx, yy = row_dots(x_ptr, roff, y_ptr, roff, rmask, K, BLOCK_R, BLOCK_K, ACC)
    op = out_ptr + rows.to(tl.int64) * 3
    tl.store(op + 0, xy, mask=rmask)
    tl.store(op + 1, xx, mask=rmask)
    tl.store(op + 2, yy, mask=rmask)


@triton.jit
def _gs_row_combine_kernel(x_ptr, y_ptr, coef_ptr, u_ptr, v_ptr, N, K,
                           BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr):
    # grid: (row tiles, K blocks)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    r64 = rows.to(tl.int64)
    cp = coef_ptr + r64 * 4
    c0 = tl.load(cp + 0, mask=rmask, other=0.0).to(ACC)[:, None]
    c1 = tl.load(cp + 1, mask=rmask, other=0.0).to(ACC)[:, None]
    c2 = tl.load(cp + 2, mask=rmask, other=0.0).to(ACC)[:, None]
    c3 = tl.load(cp + 3, mask=rmask, other=0.0).to(ACC)[:, None]
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m2 = rmask[:, None] & (cols < K)[None, :]
    offs = (r64 * K)[:, None] + cols[None, :]
    x = tl.load(x_ptr + offs, mask=m2, other=0.0).to(ACC)
    y = tl.load(y_ptr + offs, mask=m2, other=0.0).to(ACC)
    u = c0 * x + c1 * y
    v = c2 * x + c3 * y
    tl.store(u_ptr + offs, u.to(u_ptr.dtype.element_ty), mask=m2)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=m2)


def gs_row_dots(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    N, K = x.shape
    out = torch.empty((N, 3), dtype=acc_dtype(x.dtype), device=x.device)
    if N == 0:
        return out
    BLOCK_R, BLOCK_K = row_tiles(N, K, 1024, 2048, max_rows=64)
    nw = 8 if BLOCK_R * BLOCK_K >= 2048 else 4
    _gs_row_dots_kernel[(triton.cdiv(N, BLOCK_R),)](
        x, y, out, N, K, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, ACC=acc_tl_dtype(x), num_warps=nw)
    return out


def gs_row_combine(x: torch.Tensor, y: torch.Tensor, coef: torch.Tensor):
    N, K = x.shape
    u = torch.empty_like(x)
    v = torch.empty_like(x)
    if N == 0 or K == 0:
        return u, v
    BLOCK_R, BLOCK_K = row_tiles(N, K, 2048, 2048, max_rows=64)
    nw = 8 if BLOCK_R * BLOCK_K >= 2048 else 4
    grid = (triton.cdiv(N, BLOCK_R), triton.cdiv(K, BLOCK_K))
    _gs_row_combine_kernel[grid](x, y, coef, u, v, N, K, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
                                 ACC=acc_tl_dtype(x), num_warps=nw)
    return u, v
