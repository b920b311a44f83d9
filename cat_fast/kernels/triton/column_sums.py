"""Column sums of a ``[groups, rows, columns]`` tensor in one or two launches, in a fixed order: the step that adds
the partial sums the row-sum kernels write (one row per program: `residual_layer_norm.backward_with_params`,
`gelu_bias_backward`), and a bias gradient's sums over the rows of a 16-bit gradient (`cat_fast.layers.training`).

`concat` joins three [N, D] tensors along the columns (``torch.cat(parts, 1)``: flash attention's dq, dk and dv,
the gradient of the packed query, key and value projections, `cat_fast.layers.packing`) and sums the columns of the
result in the same pass (their bias's gradient), rather than reading the joined gradient again. Given `gather`, the
second and third parts are read in another row order (row ``gather[i]`` of each for output row i, a zero row where
``gather[i] < 0``): the key and value gradients of variable-length attention whose keys were gathered apart from
the queries, put back in the rows' order in the same pass.
"""
import torch
import triton
import triton.language as tl

from ._common import partial_programs, pow2_at_least, runs

__all__ = ["column_sums", "concat", "LAUNCH"]

# `concat`'s rows and columns per tile, programs per multiprocessor along the rows, and warps: on an H200
# (2026-11-29, three [N, 768] bf16 parts) 64 x 128 at 1 per multiprocessor took 10.4 / 37.6 µs at 3,200 / 12,800
# rows, the sweep's best 9.9 / 37.6, against 14.6 / 40.5 for 32 x 128 at 2 and 13.3 / 71.7 for torch.cat then
# `column_sums`
LAUNCH = {"concat_rows": 64, "concat_cols": 128, "concat_per_sm": 1, "concat_warps": 4}


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


@triton.jit
def _concat_kernel(a_ptr, b_ptr, c_ptr, gather_ptr, out_ptr, part_ptr, n_rows, D, stride_a, stride_b, stride_c,
                   rows_per_program, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WANT_SUM: tl.constexpr,
                   GATHER: tl.constexpr):
    program = tl.program_id(0)
    which = tl.program_id(2)  # the part: its columns are which * D + [0, D) of the output
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = cols < D
    if which == 0:
        src = a_ptr
        stride = stride_a
    elif which == 1:
        src = b_ptr
        stride = stride_b
    else:
        src = c_ptr
        stride = stride_c
    first = program.to(tl.int64) * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=part_ptr.dtype.element_ty)
    for start in range(0, rows_per_program, BLOCK_M):
        rows = first + start + tl.arange(0, BLOCK_M)
        m = (rows < end)[:, None] & inside[None, :]
        read, take = rows, m
        if GATHER:
            if which > 0:  # the key and value parts: row gather[i], none where it is negative
                read = tl.load(gather_ptr + rows, mask=rows < end, other=-1).to(tl.int64)
                take = m & (read >= 0)[:, None]
        x = tl.load(src + read[:, None] * stride + cols[None, :], mask=take, other=0.0)
        tl.store(out_ptr + rows[:, None] * (3 * D) + which * D + cols[None, :], x, mask=m)
        if WANT_SUM:
            acc += x.to(part_ptr.dtype.element_ty)
    if WANT_SUM:
        tl.store(part_ptr + program * (3 * D) + which * D + cols, tl.sum(acc, axis=0), mask=inside)


def concat(parts, want_sums: bool = True, gather: torch.Tensor | None = None):
    """``(torch.cat(parts, 1), its column sums in fp32 (float64 stays float64) or None)`` for three 2-D tensors
    `parts` of one shape [N, D], dtype and device, in one launch that reads each element once (two with the sums:
    each program sums a run of rows, then `column_sums` adds the programs' partial sums, in a fixed order).
    `gather` (an integer [N] tensor on their device, entries in [-1, N)): output row i takes row ``gather[i]`` of the
    second and third parts, zeros where it is -1 (the first part's row i as ever). Entries are not checked on the
    device: an out-of-range one reads out of bounds, so its makers compute it (`layers.packing.Plan.key_sources`)."""
    if len(parts) != 3 or any(not isinstance(t, torch.Tensor) or t.dim() != 2 for t in parts):
        raise ValueError("parts: expected three 2-D tensors")
    a, b, c = parts
    if a.shape != b.shape or a.shape != c.shape or not a.dtype == b.dtype == c.dtype or not (
            a.device == b.device == c.device):
        found = [(tuple(t.shape), t.dtype, str(t.device)) for t in parts]
        raise ValueError(f"parts: expected one shape, dtype and device, got {found}")
    if gather is not None and (not isinstance(gather, torch.Tensor) or gather.dim() != 1
                               or gather.shape[0] != a.shape[0] or gather.dtype not in (torch.int32, torch.int64)
                               or gather.device != a.device):
        raise ValueError(f"gather: expected an int32 or int64 tensor of shape ({a.shape[0]},) on {a.device}, got "
                         f"{getattr(gather, 'dtype', type(gather).__name__)} of shape "
                         f"{tuple(getattr(gather, 'shape', ()))} on {getattr(gather, 'device', None)}")
    a, b, c = (t if t.stride(1) == 1 else t.contiguous() for t in parts)
    n, D = a.shape
    out = torch.empty(n, 3 * D, device=a.device, dtype=a.dtype)
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    if n == 0 or D == 0:
        return out, (torch.zeros(3 * D, device=a.device, dtype=acc) if want_sums else None)
    block_m = LAUNCH["concat_rows"]
    block_n = min(pow2_at_least(D), LAUNCH["concat_cols"])
    programs, per_program = runs(n, block_m, partial_programs(triton.cdiv(n, block_m), a.device,
                                                               per_sm=LAUNCH["concat_per_sm"]))
    part = torch.empty(programs, 3 * D, device=a.device, dtype=acc) if want_sums else out
    _concat_kernel[(programs, triton.cdiv(D, block_n), 3)](a, b, c, a if gather is None else gather, out, part, n,
                                                            D, a.stride(0), b.stride(0), c.stride(0), per_program,
                                                            BLOCK_M=block_m, BLOCK_N=block_n,
                                                            WANT_SUM=bool(want_sums), GATHER=gather is not None,
                                                            num_warps=LAUNCH["concat_warps"])
    if not want_sums:
        return out, None
    return out, (part[0] if programs == 1 else column_sums(part.unsqueeze(0), 3 * D)[0])
