"""Residual add + LayerNorm over the last dimension, forward and backward, fused for `cat_fast.layers.resumed` and
`cat_fast.layers.training` (a post-LN encoder sublayer: ``y = LayerNorm(branch + residual)``).

Forward: ``s = float(branch) + residual``; ``y = (s - mean) * rstd * weight + bias`` in fp32, optionally also
written in a 16-bit dtype (the next projection's input). Backward: from ``grad_y`` (fp32), ``grad_s`` — the
residual's gradient — and, for the branch, ``grad_s * keep * scale`` in the branch's dtype (the branch went
through dropout with that mask and scale). `backward_with_params` also sums, over the rows, the LayerNorm's weight
and bias gradients and the gradient of the bias the branch's projection added (the sum of the branch's gradient as
rounded to its dtype), in fp32: each program sums a run of rows, and one more launch adds the programs' partial
sums (`column_sums`). The same arithmetic as `reference_forward` / `reference_backward` /
`reference_backward_with_params`.
"""
import torch
import triton
import triton.language as tl

from ._common import partial_programs, pow2_at_least, runs
from .column_sums import column_sums

__all__ = ["forward", "backward", "backward_with_params", "reference_forward", "reference_backward",
           "reference_backward_with_params"]


@triton.jit
def _row_sum(branch_ptr, residual_ptr, row, D, BLOCK: tl.constexpr):
    """(columns, their mask, the row's offset, float32 branch + residual) of one row."""
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    base = row * D
    s = tl.load(branch_ptr + base + cols, mask=inside, other=0.0).to(tl.float32)
    s += tl.load(residual_ptr + base + cols, mask=inside, other=0.0).to(tl.float32)
    return cols, inside, base, s


@triton.jit
def _forward_kernel(branch_ptr, residual_ptr, weight_ptr, bias_ptr, y_ptr, y16_ptr, mean_ptr, rstd_ptr, D, eps,
                    BLOCK: tl.constexpr, WRITE16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols, inside, base, s = _row_sum(branch_ptr, residual_ptr, row, D, BLOCK)
    mean = tl.sum(s, axis=0) / D
    centred = tl.where(inside, s - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / D + eps)
    w = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    y = centred * rstd * w + b
    tl.store(y_ptr + base + cols, y, mask=inside)
    if WRITE16:
        tl.store(y16_ptr + base + cols, y.to(y16_ptr.dtype.element_ty), mask=inside)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _tile_loads(grad_y_ptr, branch_ptr, residual_ptr, keep_ptr, mean_ptr, rstd_ptr, rows, end, cols, D,
                HAS_KEEP: tl.constexpr):
    """The inputs of rows `rows` ([R] int64; those at or past `end` masked out), columns `cols`: (grad_y, s =
    branch + residual, keep (0 where there is none), mean, rstd), fp32 but keep, zero where masked."""
    inside = rows < end
    m = inside[:, None] & (cols < D)[None, :]
    offsets = rows[:, None] * D + cols[None, :]
    mean = tl.load(mean_ptr + rows, mask=inside, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=inside, other=0.0)
    s = tl.load(branch_ptr + offsets, mask=m, other=0.0).to(tl.float32)
    s += tl.load(residual_ptr + offsets, mask=m, other=0.0).to(tl.float32)
    grad_y = tl.load(grad_y_ptr + offsets, mask=m, other=0.0).to(tl.float32)
    if HAS_KEEP:
        keep = tl.load(keep_ptr + offsets, mask=m, other=0)
    else:
        keep = tl.zeros_like(offsets).to(tl.uint8)
    return grad_y, s, keep, mean, rstd


@triton.jit
def _tile_compute(grad_y, s, keep, mean, rstd, grad_s_ptr, grad_branch_ptr, rows, end, cols, w, D, scale,
                  HAS_KEEP: tl.constexpr):
    """The backward of the loaded rows (`_tile_loads`): stores grad_s (fp32) and grad_branch (in its dtype);
    returns (x_hat, grad_branch as rounded), [R, BLOCK] in fp32, zero where masked."""
    m = (rows < end)[:, None] & (cols < D)[None, :]
    offsets = rows[:, None] * D + cols[None, :]
    x_hat = tl.where(m, (s - mean[:, None]) * rstd[:, None], 0.0)
    g_hat = grad_y * w[None, :]
    c_hat = tl.sum(x_hat * g_hat, axis=1)[:, None] / D
    c_one = tl.sum(g_hat, axis=1)[:, None] / D
    grad_s = (g_hat - x_hat * c_hat - c_one) * rstd[:, None]
    tl.store(grad_s_ptr + offsets, grad_s, mask=m)
    grad_branch = grad_s * scale
    if HAS_KEEP:
        grad_branch = tl.where(keep != 0, grad_branch, 0.0)
    rounded = grad_branch.to(grad_branch_ptr.dtype.element_ty)
    tl.store(grad_branch_ptr + offsets, rounded, mask=m)
    return x_hat, tl.where(m, rounded.to(tl.float32), 0.0)


@triton.jit
def _tile_gradients(grad_y_ptr, branch_ptr, residual_ptr, keep_ptr, grad_s_ptr, grad_branch_ptr, mean_ptr, rstd_ptr,
                    rows, n_rows, cols, w, D, scale, HAS_KEEP: tl.constexpr):
    """The backward of the rows `rows` ([R] int64; those at or past `n_rows` masked out), columns `cols`: stores
    grad_s (fp32) and grad_branch (in its dtype); returns (grad_y, x_hat, grad_branch as rounded), [R, BLOCK] in
    fp32, zero where masked."""
    grad_y, s, keep, mean, rstd = _tile_loads(grad_y_ptr, branch_ptr, residual_ptr, keep_ptr, mean_ptr, rstd_ptr,
                                              rows, n_rows, cols, D, HAS_KEEP)
    x_hat, rounded = _tile_compute(grad_y, s, keep, mean, rstd, grad_s_ptr, grad_branch_ptr, rows, n_rows, cols, w,
                                   D, scale, HAS_KEEP)
    return grad_y, x_hat, rounded


@triton.jit
def _backward_kernel(grad_y_ptr, branch_ptr, residual_ptr, weight_ptr, mean_ptr, rstd_ptr, keep_ptr, grad_s_ptr,
                     grad_branch_ptr, n_rows, D, scale, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                     HAS_KEEP: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    w = tl.load(weight_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    _tile_gradients(grad_y_ptr, branch_ptr, residual_ptr, keep_ptr, grad_s_ptr, grad_branch_ptr, mean_ptr, rstd_ptr,
                    rows, n_rows, cols, w, D, scale, HAS_KEEP)


@triton.jit
def _backward_params_kernel(grad_y_ptr, branch_ptr, residual_ptr, weight_ptr, mean_ptr, rstd_ptr, keep_ptr,
                            grad_s_ptr, grad_branch_ptr, part_ptr, n_rows, D, rows_per_program, n_programs, scale,
                            ROWS: tl.constexpr, BLOCK: tl.constexpr, HAS_KEEP: tl.constexpr,
                            PREFETCH: tl.constexpr):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    w = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    sum_weight = tl.zeros([BLOCK], dtype=tl.float32)
    sum_bias = tl.zeros([BLOCK], dtype=tl.float32)
    sum_branch = tl.zeros([BLOCK], dtype=tl.float32)
    first = program.to(tl.int64) * rows_per_program  # rows_per_program: a multiple of ROWS
    if PREFETCH:  # the next rows' loads issued before this rows' arithmetic: their latency overlaps it
        end = tl.minimum(first + rows_per_program, n_rows)
        rows = first + tl.arange(0, ROWS)
        grad_y, s, keep, mean, rstd = _tile_loads(grad_y_ptr, branch_ptr, residual_ptr, keep_ptr, mean_ptr,
                                                  rstd_ptr, rows, end, cols, D, HAS_KEEP)
        for start in range(0, rows_per_program, ROWS):
            following = rows + ROWS
            grad_y_n, s_n, keep_n, mean_n, rstd_n = _tile_loads(grad_y_ptr, branch_ptr, residual_ptr, keep_ptr,
                                                                mean_ptr, rstd_ptr, following, end, cols, D,
                                                                HAS_KEEP)
            x_hat, rounded = _tile_compute(grad_y, s, keep, mean, rstd, grad_s_ptr, grad_branch_ptr, rows, end,
                                           cols, w, D, scale, HAS_KEEP)
            sum_weight += tl.sum(grad_y * x_hat, axis=0)
            sum_bias += tl.sum(grad_y, axis=0)
            sum_branch += tl.sum(rounded, axis=0)
            rows, grad_y, s, keep, mean, rstd = following, grad_y_n, s_n, keep_n, mean_n, rstd_n
    else:
        for start in range(0, rows_per_program, ROWS):
            rows = first + start + tl.arange(0, ROWS)
            grad_y, x_hat, rounded = _tile_gradients(grad_y_ptr, branch_ptr, residual_ptr, keep_ptr, grad_s_ptr,
                                                     grad_branch_ptr, mean_ptr, rstd_ptr, rows, n_rows, cols, w, D,
                                                     scale, HAS_KEEP)
            sum_weight += tl.sum(grad_y * x_hat, axis=0)
            sum_bias += tl.sum(grad_y, axis=0)
            sum_branch += tl.sum(rounded, axis=0)
    tl.store(part_ptr + program * BLOCK + cols, sum_weight, mask=inside)
    tl.store(part_ptr + (n_programs + program) * BLOCK + cols, sum_bias, mask=inside)
    tl.store(part_ptr + (2 * n_programs + program) * BLOCK + cols, sum_branch, mask=inside)


# Launch settings of the backward kernels: rows per program (per iteration, for the row-sum kernel; a power of two),
# the fewest rows a row-sum program covers, row-sum programs per multiprocessor, whether a row-sum iteration loads
# the next rows before its arithmetic, and the row-sum kernel's warps (None: 4, or 8 for tiles over 2,048 elements).
# `benchmarks/tools/row_kernels.py` sweeps them (H200, D = 768): one row at a time is fastest at 1,024 / 4,096 /
# 16,384 rows (tiles of 2-8 rows spill registers: 3-6x slower; 2026-11-27), and loading the next row ahead took the
# row-sum kernel from 19.1 to 15.7 µs at 3,136 rows and from 57.7 to 49.5 µs at 12,288 (the packed rows of the
# 32x128 and 64x256 steps; 45 % and 58 % of the memory bandwidth before, 54 % and 68 % after; 2026-11-29).
LAUNCH = {"backward_rows": 1, "params_rows": 1, "params_min_rows": 8, "params_per_sm": 4, "params_prefetch": True,
          "params_warps": None}


def _warps(block, rows):
    return 4 if block * rows <= 2048 else 8


def _rows(t, D):
    return t.contiguous().view(-1, D)


def forward(branch, residual, weight, bias, eps, out16_dtype=None):
    """``(y fp32, y in out16_dtype or None, mean, rstd)`` for ``y = LayerNorm(branch + residual)``; all inputs on
    one CUDA device, rows of length ``D = weight.numel()``."""
    D = weight.numel()
    b, r = _rows(branch, D), _rows(residual, D)
    n = b.shape[0]
    y = torch.empty(n, D, device=b.device, dtype=torch.float32)
    y16 = torch.empty(n, D, device=b.device, dtype=out16_dtype) if out16_dtype is not None else y
    mean = torch.empty(n, device=b.device, dtype=torch.float32)
    rstd = torch.empty(n, device=b.device, dtype=torch.float32)
    if n:
        block = pow2_at_least(D)
        _forward_kernel[(n,)](b, r, weight.contiguous(), bias.contiguous(), y, y16, mean, rstd, D, float(eps),
                              BLOCK=block, WRITE16=out16_dtype is not None, num_warps=4 if block <= 2048 else 8)
    shape = tuple(residual.shape)
    return y.view(shape), (y16.view(shape) if out16_dtype is not None else None), mean, rstd


def backward(grad_y, branch, residual, weight, mean, rstd, keep, scale, *, rows=None, num_warps=None):
    """``(grad_s fp32, grad_branch in branch's dtype)``; `keep` is the dropout mask (bool) or None, `scale` its
    rescale factor ``1 / (1 - p)`` (1 without dropout). `rows`, `num_warps`: launch settings (rows per program;
    `LAUNCH` by default), for the benchmarks."""
    D = weight.numel()
    g, b, r = _rows(grad_y, D), _rows(branch, D), _rows(residual, D)
    n = g.shape[0]
    grad_s = torch.empty(n, D, device=g.device, dtype=torch.float32)
    grad_branch = torch.empty(n, D, device=g.device, dtype=branch.dtype)
    k = _rows(keep, D).view(torch.uint8) if keep is not None else grad_s
    if n:
        block = pow2_at_least(D)
        rows = rows or LAUNCH["backward_rows"]
        _backward_kernel[(triton.cdiv(n, rows),)](g, b, r, weight.contiguous(), mean, rstd, k, grad_s, grad_branch, n,
                                                  D, float(scale), ROWS=rows, BLOCK=block, HAS_KEEP=keep is not None,
                                                  num_warps=num_warps or _warps(block, rows))
    shape = tuple(residual.shape)
    return grad_s.view(shape), grad_branch.view(shape)


def backward_with_params(grad_y, branch, residual, weight, mean, rstd, keep, scale, *, rows=None, min_rows=None,
                         per_sm=None, num_warps=None, prefetch=None):
    """``(grad_s fp32, grad_branch in branch's dtype, grad_weight, grad_bias, grad_branch_bias)``: `backward`'s two
    gradients and the sums over the rows of ``grad_y * x_hat`` (the LayerNorm weight's gradient), ``grad_y`` (its
    bias's) and ``grad_branch`` as rounded to the branch's dtype (the gradient of a bias added to the branch
    before its dropout), all three in fp32 (views of one [3, D] buffer). `rows` (per iteration), `min_rows` (per
    program), `per_sm` (programs per multiprocessor), `num_warps`, `prefetch` (each iteration loads the next rows
    before its arithmetic): launch settings (`LAUNCH` by default), for the benchmarks."""
    D = weight.numel()
    g, b, r = _rows(grad_y, D), _rows(branch, D), _rows(residual, D)
    n = g.shape[0]
    grad_s = torch.empty(n, D, device=g.device, dtype=torch.float32)
    grad_branch = torch.empty(n, D, device=g.device, dtype=branch.dtype)
    if n == 0:
        zeros = torch.zeros(D, device=g.device, dtype=torch.float32)
        shape = tuple(residual.shape)
        return grad_s.view(shape), grad_branch.view(shape), zeros, zeros.clone(), zeros.clone()
    k = _rows(keep, D).view(torch.uint8) if keep is not None else grad_s
    block = pow2_at_least(D)
    rows = rows or LAUNCH["params_rows"]
    programs = partial_programs(n, g.device, min_rows=min_rows or LAUNCH["params_min_rows"],
                                per_sm=per_sm or LAUNCH["params_per_sm"])
    programs, per_program = runs(n, rows, programs)  # whole iterations of `rows` rows
    part = torch.empty(3, programs, block, device=g.device, dtype=torch.float32)
    _backward_params_kernel[(programs,)](g, b, r, weight.contiguous(), mean, rstd, k, grad_s, grad_branch, part, n,
                                         D, per_program, programs, float(scale), ROWS=rows, BLOCK=block,
                                         HAS_KEEP=keep is not None,
                                         PREFETCH=bool(LAUNCH["params_prefetch"] if prefetch is None else prefetch),
                                         num_warps=num_warps or LAUNCH["params_warps"] or _warps(block, rows))
    sums = column_sums(part, D)
    shape = tuple(residual.shape)
    return grad_s.view(shape), grad_branch.view(shape), sums[0], sums[1], sums[2]


def reference_forward(branch, residual, weight, bias, eps, out16_dtype=None):
    """The same in PyTorch ops (statistics in float32, or float64 for float64 inputs)."""
    acc = torch.promote_types(residual.dtype, torch.float32)
    s = branch.to(acc) + residual.to(acc)
    mean = s.mean(-1)
    centred = s - mean.unsqueeze(-1)
    rstd = torch.rsqrt(centred.square().mean(-1) + eps)
    y = centred * rstd.unsqueeze(-1) * weight.to(acc) + bias.to(acc)
    return y, (y.to(out16_dtype) if out16_dtype is not None else None), mean.reshape(-1), rstd.reshape(-1)


def reference_backward(grad_y, branch, residual, weight, mean, rstd, keep, scale):
    acc = torch.promote_types(residual.dtype, torch.float32)
    s = branch.to(acc) + residual.to(acc)
    shape = s.shape
    mean, rstd = mean.view(*shape[:-1], 1), rstd.view(*shape[:-1], 1)
    x_hat = (s - mean) * rstd
    g_hat = grad_y.to(acc) * weight.to(acc)
    grad_s = (g_hat - x_hat * (x_hat * g_hat).mean(-1, keepdim=True) - g_hat.mean(-1, keepdim=True)) * rstd
    grad_branch = grad_s * scale
    if keep is not None:
        grad_branch = torch.where(keep, grad_branch, 0.0)
    return grad_s, grad_branch.to(branch.dtype)


def reference_backward_with_params(grad_y, branch, residual, weight, mean, rstd, keep, scale):
    """`backward_with_params` in PyTorch ops."""
    grad_s, grad_branch = reference_backward(grad_y, branch, residual, weight, mean, rstd, keep, scale)
    acc = grad_s.dtype
    s = branch.to(acc) + residual.to(acc)
    x_hat = (s - mean.view(*s.shape[:-1], 1)) * rstd.view(*s.shape[:-1], 1)
    rows = grad_y.to(acc).reshape(-1, s.shape[-1])
    return (grad_s, grad_branch, (rows * x_hat.reshape(rows.shape)).sum(0), rows.sum(0),
            grad_branch.reshape(rows.shape).to(acc).sum(0))
