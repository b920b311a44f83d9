"""Column sums of a ``[groups, rows, columns]`` tensor in one or two launches, in a fixed order: the step that adds
the partial sums the row-sum kernels write (one row per program: `residual_layer_norm.backward_with_params`,
`gelu_bias_backward`), and a bias gradient's sums over the rows of a 16-bit gradient (`cat_fast.layers.training`).
"""
import torch
import triton
import triton.language as tl

from ._common import partial_programs, pow2_at_least

__all__ = ["column_sums"]


@triton.jit
def _column_sums_kernel(part_ptr, out_ptr, P, N, stride_group, stride_row, rows_per_split, n_splits,
                        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    group = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = cols < N
    base = part_ptr + group * stride_group
    first = split * rows_per_split  # rows_per_split: a multiple of BLOCK_P
    end = tl.minimum(first + rows_per_split, P)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=out_ptr.dtype.element_ty)
    for start in range(0, rows_per_split, BLOCK_P):
        rows = first + start + tl.arange(0, BLOCK_P)
        m = (rows < end)[:, None] & inside[None, :]
        acc += tl.load(base + rows.to(tl.int64)[:, None] * stride_row + cols[None, :], mask=m,
                       other=0.0).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (group * n_splits + split) * N + cols, tl.sum(acc, axis=0), mask=inside)


def column_sums(part: torch.Tensor, n_cols: int) -> torch.Tensor:
    """``part[:, :, :n_cols].sum(1)`` of a ``[groups, rows, >= n_cols]`` tensor with unit column stride (the
    partial sums the row-sum kernels write, one row per program; or a 16-bit gradient whose column sums are a bias
    gradient), in fp32 (float64 stays float64), in a fixed order: one launch, or for many rows two (the rows split
    over programs, then their partial sums)."""
    if part.dim() != 3:
        raise ValueError(f"part: expected a 3-D tensor [groups, rows, columns], got shape {tuple(part.shape)}")
    groups, rows, _ = part.shape
    acc = torch.float64 if part.dtype == torch.float64 else torch.float32
    if rows == 0 or n_cols == 0 or groups == 0:
        return torch.zeros(groups, n_cols, device=part.device, dtype=acc)
    if part.stride(2) != 1:
        part = part.contiguous()
    # narrow column blocks: many programs (a launch is latency-bound); 128 columns took 9.6 µs a call in a 32x128
    # step on an H200 (2026-11-27)
    block_n = min(pow2_at_least(n_cols), 32)
    block_p = max(1, min(pow2_at_least(rows), 2048 // block_n))
    column_blocks = triton.cdiv(n_cols, block_n)
    # long sums (a bias gradient over every row): the rows split so that there are ~4 programs per multiprocessor
    splits = 1
    if rows > 8 * block_p:
        want = partial_programs(rows, part.device)  # ~4 per multiprocessor (8 elsewhere)
        splits = max(1, min(want // (column_blocks * groups), triton.cdiv(rows, 4 * block_p)))
    per_split = block_p * triton.cdiv(rows, block_p * splits)
    splits = triton.cdiv(rows, per_split)
    out = torch.empty(groups, splits, n_cols, device=part.device, dtype=acc)
    _column_sums_kernel[(column_blocks, groups, splits)](part, out, rows, n_cols, part.stride(0), part.stride(1),
                                                         per_split, splits, BLOCK_P=block_p, BLOCK_N=block_n,
                                                         num_warps=4)
    return out[:, 0] if splits == 1 else column_sums(out, n_cols)
