"""The backward of the backward of LayerNorm and of GELU (erf form), fused: what a double backward through a
transformer's LayerNorms and activations costs in eager autograd is a few dozen elementwise and reduction kernels
per layer; here it is one pass over the rows (`cat_fast.layers.double_layers`).

LayerNorm over rows of D elements, ``x_hat = (x - mean) * rstd``, ``g = dy * w``, ``<u>`` the row mean of u:

    dx = rstd * (g - <g> - x_hat <g x_hat>),   dw = sum over rows of dy x_hat,   db = sum over rows of dy

Given the cotangents ``a`` (of dx), ``c`` (of dw) and ``e`` (of db), with ``Pa = a - <a> - x_hat <a x_hat>`` and
``(a . dx)`` the row's sum of a * dx:

    g_dy = w rstd Pa + c x_hat + e
    g_w  = sum over rows of dy rstd Pa
    h    = c dy - rstd (a <g x_hat> + <a x_hat> g)
    g_x  = rstd (h - <h> - x_hat <h x_hat>) - (a . dx) rstd x_hat / D

(h is the gradient with respect to x_hat at fixed rstd; the last term is rstd's own dependence on x). The bias has
no part in dx, dw or db. GELU, ``y = x Phi(x)``: ``dx = dy (Phi(x) + x phi(x))``; given ``a`` (of dx),
``g_dy = a (Phi + x phi)`` and ``g_x = a dy phi(x) (2 - x^2)``.

Arithmetic in float32 (float64 for float64 inputs); outputs in the input's dtype. The same formulas in PyTorch ops:
`cat_fast.kernels.reference.double_backward`.
"""
import math

import torch
import triton
import triton.language as tl

from ..dtypes import acc_dtype
from ._common import acc_tl_dtype, partial_programs, pow2_at_least, runs, scalar_acc, split_scalar
from .column_sums import column_sums

__all__ = ["layer_norm", "gelu"]


@triton.jit
def _layer_norm_row(x_ptr, dy_ptr, a_ptr, mean_ptr, rstd_ptr, gx_ptr, gdy_ptr, row, n_rows, cols, w, c, e, D,
                    ACC: tl.constexpr):
    """Stores one row's g_x and g_dy; returns its part of g_w (zero past the last row)."""
    m = cols < tl.where(row < n_rows, D, 0)
    offsets = row * D + cols
    x = tl.load(x_ptr + offsets, mask=m, other=0.0).to(ACC)
    dy = tl.load(dy_ptr + offsets, mask=m, other=0.0).to(ACC)
    a = tl.load(a_ptr + offsets, mask=m, other=0.0).to(ACC)
    safe = tl.minimum(row, n_rows - 1)  # a row past the last reads the last row's statistics, masked out below
    mean = tl.load(mean_ptr + safe).to(ACC)
    rstd = tl.load(rstd_ptr + safe).to(ACC)
    x_hat = tl.where(m, (x - mean) * rstd, 0.0)
    g = dy * w
    a_mean = tl.sum(a, axis=0) / D
    ax_mean = tl.sum(a * x_hat, axis=0) / D
    g_mean = tl.sum(g, axis=0) / D
    gx_mean = tl.sum(g * x_hat, axis=0) / D
    r_pa = tl.where(m, rstd * (a - a_mean - x_hat * ax_mean), 0.0)
    a_dx = rstd * (tl.sum(a * g, axis=0) - D * (a_mean * g_mean + ax_mean * gx_mean))
    h = tl.where(m, c * dy - rstd * (a * gx_mean + ax_mean * g), 0.0)
    h_mean = tl.sum(h, axis=0) / D
    hx_mean = tl.sum(h * x_hat, axis=0) / D
    g_x = rstd * (h - h_mean - x_hat * hx_mean) - a_dx * rstd * x_hat / D
    g_dy = w * r_pa + c * x_hat + e
    tl.store(gx_ptr + offsets, g_x.to(gx_ptr.dtype.element_ty), mask=m)
    tl.store(gdy_ptr + offsets, g_dy.to(gdy_ptr.dtype.element_ty), mask=m)
    return dy * r_pa


@triton.jit
def _layer_norm_kernel(x_ptr, dy_ptr, a_ptr, w_ptr, c_ptr, e_ptr, mean_ptr, rstd_ptr, gx_ptr, gdy_ptr, part_ptr,
                       n_rows, D, rows_per_program, ACC: tl.constexpr, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(ACC)
    c = tl.load(c_ptr + cols, mask=inside, other=0.0).to(ACC)
    e = tl.load(e_ptr + cols, mask=inside, other=0.0).to(ACC)
    g_w = tl.zeros([BLOCK], dtype=ACC)
    first = program.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        g_w += _layer_norm_row(x_ptr, dy_ptr, a_ptr, mean_ptr, rstd_ptr, gx_ptr, gdy_ptr, first + i, n_rows, cols,
                               w, c, e, D, ACC)
    tl.store(part_ptr + program * BLOCK + cols, g_w, mask=inside)


@triton.jit
def _gelu_kernel(x_ptr, dy_ptr, a_ptr, gx_ptr, gdy_ptr, n, root_half_hi, root_half_lo, pdf_hi, pdf_lo,
                 ACC: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offsets < n
    x = tl.load(x_ptr + offsets, mask=m, other=0.0).to(ACC)
    dy = tl.load(dy_ptr + offsets, mask=m, other=0.0).to(ACC)
    a = tl.load(a_ptr + offsets, mask=m, other=0.0).to(ACC)
    cdf = 0.5 * (1.0 + tl.math.erf(x * scalar_acc(root_half_hi, root_half_lo, ACC)))
    pdf = tl.exp(-0.5 * x * x) * scalar_acc(pdf_hi, pdf_lo, ACC)
    tl.store(gdy_ptr + offsets, (a * (cdf + x * pdf)).to(gdy_ptr.dtype.element_ty), mask=m)
    tl.store(gx_ptr + offsets, (a * dy * pdf * (2.0 - x * x)).to(gx_ptr.dtype.element_ty), mask=m)


# Rows per program of the LayerNorm kernel: at least this many, at about this many programs per multiprocessor
# (the row-sum layout of `residual_layer_norm.backward_with_params`).
LAUNCH = {"min_rows": 8, "per_sm": 4, "gelu_block": 1024}


_ROOT_HALF = split_scalar(math.sqrt(0.5))  # erf's argument scale and the normal density's, float64 in float64 kernels
_PDF = split_scalar(1.0 / math.sqrt(2.0 * math.pi))


def layer_norm(x, weight, dy, a, c, e, mean, rstd):
    """``(g_x, g_w, g_dy)`` of LayerNorm's backward at ``(x, weight, dy)`` for the cotangents `a` (of dx, shaped
    like x), `c` and `e` (of the weight's and bias's gradients, shaped like weight); `mean`, `rstd`: the forward's
    row statistics (one per row of ``D = weight.numel()`` elements). g_x in x's dtype, g_dy in dy's, g_w in the
    accumulation dtype."""
    D = weight.numel()
    rows = [t.contiguous().view(-1, D) for t in (x, dy, a)]
    n = rows[0].shape[0]
    g_x = torch.empty_like(rows[0])
    g_dy = torch.empty_like(rows[1])
    acc = acc_dtype(x.dtype)
    if n == 0:
        return g_x.view(x.shape), torch.zeros(D, device=x.device, dtype=acc), g_dy.view(dy.shape)
    block = pow2_at_least(D)
    programs, per_program = runs(n, 1, partial_programs(n, x.device, min_rows=LAUNCH["min_rows"],
                                                         per_sm=LAUNCH["per_sm"]))
    part = torch.empty(1, programs, block, device=x.device, dtype=acc)
    vectors = [t.contiguous().view(-1) for t in (weight, c, e)]
    _layer_norm_kernel[(programs,)](*rows, *vectors, mean.contiguous().view(-1), rstd.contiguous().view(-1), g_x,
                                    g_dy, part, n, D, per_program, ACC=acc_tl_dtype(x), BLOCK=block,
                                    num_warps=4 if block <= 2048 else 8)
    return g_x.view(x.shape), column_sums(part, D)[0], g_dy.view(dy.shape)


def gelu(x, dy, a):
    """``(g_x, g_dy)`` of GELU's backward ``dx = dy * gelu'(x)`` for the cotangent `a` of dx; all three one shape,
    outputs in x's and dy's dtypes."""
    flat = [t.contiguous().view(-1) for t in (x, dy, a)]
    g_x, g_dy = torch.empty_like(flat[0]), torch.empty_like(flat[1])
    n = flat[0].numel()
    if n:
        block = LAUNCH["gelu_block"]
        _gelu_kernel[(triton.cdiv(n, block),)](*flat, g_x, g_dy, n, *_ROOT_HALF, *_PDF, ACC=acc_tl_dtype(x),
                                               BLOCK=block, num_warps=4)
    return g_x.view(x.shape), g_dy.view(dy.shape)
