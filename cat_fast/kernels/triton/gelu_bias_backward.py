"""The backward of ``gelu(inner)`` (exact, erf form) where ``inner = x @ W.T + b``, fused for
`cat_fast.layers.training`: ``grad_inner = grad * (Φ(inner) + inner · φ(inner))`` computed in fp32 from the
16-bit inputs and rounded to the input dtype — PyTorch's ``gelu_backward`` (``approximate="none"``) — and the bias
gradient, the column sums of ``grad_inner`` as rounded, in fp32 (PyTorch's ``grad_inner.sum(0, dtype=float32)``).
Each program covers a run of rows of one block of columns; one more launch adds the programs' partial sums
(`column_sums`).
The same arithmetic as `reference_backward`.
"""
import math

import torch
import triton
import triton.language as tl

from ._common import partial_programs, runs
from .column_sums import column_sums

__all__ = ["backward", "reference_backward"]

_SQRT1_2 = 1.0 / math.sqrt(2.0)
_PDF_SCALE = 2.0 / math.sqrt(math.pi) * _SQRT1_2 * 0.5  # 1 / sqrt(2 pi), as PyTorch's kernel spells it


@triton.jit
def _kernel(grad_ptr, inner_ptr, out_ptr, part_ptr, n_rows, N, rows_per_program, sqrt1_2, pdf_scale,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WANT_SUM: tl.constexpr, TILE_SUMS: tl.constexpr):
    program = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = cols < N
    first = program.to(tl.int64) * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    tile = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # TILE_SUMS: one sum over the rows, after the loop
    for start in range(0, rows_per_program, BLOCK_M):
        rows = first + start + tl.arange(0, BLOCK_M)
        m = (rows < end)[:, None] & inside[None, :]
        offsets = rows[:, None] * N + cols[None, :]
        x = tl.load(inner_ptr + offsets, mask=m, other=0.0).to(tl.float32)
        g = tl.load(grad_ptr + offsets, mask=m, other=0.0).to(tl.float32)
        cdf = 0.5 * (1.0 + tl.math.erf(x * sqrt1_2))
        pdf = tl.exp(-0.5 * x * x) * pdf_scale
        rounded = (g * (cdf + x * pdf)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offsets, rounded, mask=m)
        if WANT_SUM:
            if TILE_SUMS:
                tile += tl.where(m, rounded.to(tl.float32), 0.0)
            else:
                total += tl.sum(tl.where(m, rounded.to(tl.float32), 0.0), axis=0)
    if WANT_SUM:
        if TILE_SUMS:
            total = tl.sum(tile, axis=0)
        tl.store(part_ptr + program * N + cols, total, mask=inside)


# Launch settings: rows and columns of a tile, row-sum programs per multiprocessor along the rows (each covering
# whole tiles of rows, over all column blocks), warps, and whether a program keeps a tile of sums (added over its
# rows once, after its loop) rather than adding each tile's rows as it goes. `benchmarks/tools/row_kernels.py`
# sweeps them (H200, N = 3072): 32 x 128 tiles at 2 programs per multiprocessor gave 11.3 / 42.5 / 140.6 µs at
# 1,024 / 4,096 / 16,384 rows (2026-11-27), against eager PyTorch's 14.8 / 42.5 / 131.8 and torch.compile's 13.2 /
# 48.5 / 172.0; with a tile of sums, 16 x 128 tiles at 1 per multiprocessor took 28.96 / 86.51 µs at 3,109 / 12,288
# rows (the 32x128 and 64x256 steps' packed rows) against 31.10 / 101.95 for those settings, in one process
# (2026-11-29; the elementwise work alone, no sums: 21.86 / 72.51).
LAUNCH = {"block_m": 16, "block_n": 128, "per_sm": 1, "num_warps": 4, "tile_sums": True}


def backward(grad, inner, want_bias=True, *, block_m=None, block_n=None, per_sm=None, num_warps=None,
             tile_sums=None):
    """``(grad_inner in inner's dtype, the bias gradient in fp32 or None)`` for 2-D `grad` and `inner` of one shape
    and dtype on one CUDA device. `block_m`, `block_n`, `per_sm`, `num_warps`, `tile_sums` (a program keeps a
    tile of sums and adds its rows once, at the end, rather than at every tile): launch settings (`LAUNCH` by
    default), for the benchmarks."""
    if grad.shape != inner.shape or grad.dim() != 2:
        raise ValueError(f"grad, inner: expected two 2-D tensors of one shape, got {tuple(grad.shape)} and "
                         f"{tuple(inner.shape)}")
    g, x = grad.contiguous(), inner.contiguous()
    n, N = x.shape
    out = torch.empty_like(x)
    if n == 0 or N == 0:
        return out, (torch.zeros(N, device=x.device, dtype=torch.float32) if want_bias else None)
    block_m, per_sm = block_m or LAUNCH["block_m"], per_sm or LAUNCH["per_sm"]
    block_n = min(triton.next_power_of_2(N), block_n or LAUNCH["block_n"])
    column_blocks = triton.cdiv(N, block_n)
    # each program covers a run of whole row tiles of one column block
    programs, per_program = runs(n, block_m, partial_programs(-(-n // block_m), x.device, per_sm=per_sm))
    part = torch.empty(programs, N, device=x.device, dtype=torch.float32) if want_bias else out
    _kernel[(programs, column_blocks)](g, x, out, part, n, N, per_program, _SQRT1_2, _PDF_SCALE, BLOCK_M=block_m,
                                       BLOCK_N=block_n, WANT_SUM=bool(want_bias),
                                       TILE_SUMS=bool(LAUNCH["tile_sums"] if tile_sums is None else tile_sums),
                                       num_warps=num_warps or LAUNCH["num_warps"])
    return out, (column_sums(part.unsqueeze(0), N)[0] if want_bias else None)


def reference_backward(grad, inner, want_bias=True):
    """The same in PyTorch ops."""
    out = torch.ops.aten.gelu_backward(grad, inner, approximate="none")
    return out, (out.sum(0, dtype=torch.float32) if want_bias else None)
