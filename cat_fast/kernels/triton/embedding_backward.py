"""The weight gradient of an embedding lookup, ``F.embedding(ids, weight, padding_idx)``, in a fixed order, for
`cat_fast.layers.embedding`: ``grad_weight[v] = Σ grad[i]`` over the positions i whose id is v; zero at
`padding_idx` and at ids that do not occur.

PyTorch's CUDA backward (``embedding_dense_backward``) sorts the ids as 64-bit keys and sums in a dozen launches.
Here the ids are sorted as int32 (one stable ``torch.sort``), then two launches:

- each program takes a chunk of `LAUNCH["chunk"]` consecutive sorted entries and a block of columns, gathers their
  gradient rows and sums each run of equal ids inside the chunk by a segmented scan; a run that starts and ends in the
  chunk is written to its id's row, the pieces of a run that crosses the chunk's edges to a partial buffer (at the
  row of the piece's first entry);
- each chunk in which a run that continues past its end begins adds that run's pieces: its own, then the first
  entry's of each chunk the run continues into (`LAUNCH["tile"]` at a time), and writes the id's row.

A table of at most `LAUNCH["small_table"]` rows (BERT's token types: two rows, every id 0 in a single-segment
batch) needs no sort: each program sums, for every row of the table, the gradient rows of a run of positions whose
id is that row, and one more launch adds the programs' partial sums (`column_sums`).

Positions whose id is `padding_idx` are not read. The sums run in fp32 (float64 for float64 gradients) in an order
that the ids and the launch settings fix, with no atomic additions: the same bits on every run.
`reference_backward` is PyTorch's.
"""
import torch
import triton
import triton.language as tl

from ._common import partial_programs, pow2_at_least, runs
from .column_sums import column_sums

__all__ = ["backward", "reference_backward", "LAUNCH"]

# sorted entries per program of the first launch (a power of 2), columns per program of each, and partial rows the
# second adds per iteration; the most rows a table summed without a sort may have (a power of 2), and that
# kernel's positions and columns per tile and programs per multiprocessor along the positions
LAUNCH = {"chunk": 64, "chunk_cols": 128, "row_cols": 128, "tile": 64, "small_table": 4, "small_rows": 16,
          "small_cols": 128, "small_per_sm": 2}


@triton.jit
def _segmented_add(v1, f1, v2, f2):
    """The combine of a segmented sum: (value, starts a run) pairs; a run's start drops what came before it."""
    return tl.where(f2 != 0, v2, v1 + v2), f1 | f2


@triton.jit
def _latest(a, b):
    return tl.maximum(a, b)


@triton.jit
def _chunk_kernel(ids_ptr, order_ptr, grad_ptr, part_ptr, out_ptr, N, D, stride_grad, padding_idx,
                  CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    lane = tl.arange(0, CHUNK)
    entries = tl.program_id(0) * CHUNK + lane
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    inside = cols < D
    valid = entries < N
    ids = tl.load(ids_ptr + entries, mask=valid, other=-1)
    before = tl.load(ids_ptr + entries - 1, mask=valid & (entries > 0), other=-1)  # ids >= 0: -1 is no entry
    after = tl.load(ids_ptr + entries + 1, mask=entries + 1 < N, other=-1)
    starts_run = ids != before
    ends_run = ids != after
    first = (lane == 0) | starts_run  # a piece of a run starts: the chunk's first entry, or a run's
    last = valid & ((lane == CHUNK - 1) | ends_run)
    rows = tl.load(order_ptr + entries, mask=valid, other=0).to(tl.int64)
    read = valid & (ids != padding_idx)  # the padding row's sums are never written: its rows are not read
    x = tl.load(grad_ptr + rows[:, None] * stride_grad + cols[None, :], mask=read[:, None] & inside[None, :],
                other=0.0).to(part_ptr.dtype.element_ty)
    flags = tl.broadcast_to(first.to(tl.int32)[:, None], (CHUNK, BLOCK_D))
    sums, _ = tl.associative_scan((x, flags), 0, _segmented_add)
    # each entry's piece: its first entry (times 2), plus 1 where that entry starts the run
    piece = tl.associative_scan(tl.where(first, entries * 2 + starts_run.to(tl.int32), 0), 0, _latest)
    whole = ((piece % 2) == 1) & ends_run  # the run starts and ends in this chunk
    write = last & whole & (ids != padding_idx)
    tl.store(out_ptr + ids.to(tl.int64)[:, None] * D + cols[None, :], sums.to(out_ptr.dtype.element_ty),
             mask=write[:, None] & inside[None, :])
    tl.store(part_ptr + (piece // 2).to(tl.int64)[:, None] * D + cols[None, :], sums,
             mask=(last & ~whole)[:, None] & inside[None, :])


@triton.jit
def _crossing_kernel(ids_ptr, part_ptr, out_ptr, N, D, padding_idx, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
                     TILE: tl.constexpr):
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    inside = cols < D
    base = chunk * CHUNK
    end = tl.minimum(base + CHUNK, N)  # the next chunk's first entry, or N
    v = tl.load(ids_ptr + end - 1)
    crosses = tl.load(ids_ptr + end, mask=end < N, other=-1) == v
    starts_here = tl.load(ids_ptr + base - 1, mask=base > 0, other=-1) != v
    if crosses & starts_here & (v != padding_idx):
        entries = base + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + entries, mask=entries < end, other=-1)
        first = tl.min(tl.where(ids == v, entries, N), axis=0)  # the run's first entry
        acc = tl.load(part_ptr + first.to(tl.int64) * D + cols, mask=inside, other=0.0)
        q = end
        more = crosses
        while more:
            firsts = q + tl.arange(0, TILE) * CHUNK
            same = tl.load(ids_ptr + firsts, mask=firsts < N, other=-1) == v
            tile = tl.load(part_ptr + firsts.to(tl.int64)[:, None] * D + cols[None, :],
                           mask=same[:, None] & inside[None, :], other=0.0)
            acc += tl.sum(tile, axis=0)
            q += TILE * CHUNK
            more = tl.load(ids_ptr + q, mask=q < N, other=-1) == v
        tl.store(out_ptr + v.to(tl.int64) * D + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _small_table_kernel(ids_ptr, grad_ptr, part_ptr, N, D, stride_grad, rows_per_program, padding_idx,
                        R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    program = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    inside = cols < D
    table_rows = tl.arange(0, R)
    first = program.to(tl.int64) * rows_per_program
    end = tl.minimum(first + rows_per_program, N)
    acc = tl.zeros([R, BLOCK_D], dtype=part_ptr.dtype.element_ty)
    for start in range(0, rows_per_program, BLOCK_M):
        rows = first + start + tl.arange(0, BLOCK_M)
        valid = rows < end
        ids = tl.load(ids_ptr + rows, mask=valid, other=-1)
        read = valid & (ids != padding_idx)
        x = tl.load(grad_ptr + rows[:, None] * stride_grad + cols[None, :], mask=read[:, None] & inside[None, :],
                    other=0.0).to(part_ptr.dtype.element_ty)
        hit = (ids[:, None] == table_rows[None, :]) & read[:, None]  # [BLOCK_M, R]
        acc += tl.sum(tl.where(hit[:, :, None], x[:, None, :], 0.0), axis=0)
    tl.store(part_ptr + (program * R + table_rows).to(tl.int64)[:, None] * D + cols[None, :], acc,
             mask=inside[None, :])


def _small_table(g, flat, num_weights, pad, acc_dtype):
    """[num_weights, D] sums in `acc_dtype` of a table of at most ``LAUNCH["small_table"]`` rows, without a sort."""
    N, D = g.shape
    R = max(2, pow2_at_least(num_weights))
    block_m, block_d = LAUNCH["small_rows"], LAUNCH["small_cols"]
    programs, per_program = runs(N, block_m, partial_programs(triton.cdiv(N, block_m), g.device,
                                                               per_sm=LAUNCH["small_per_sm"]))
    part = torch.empty(programs, R, D, device=g.device, dtype=acc_dtype)
    _small_table_kernel[(programs, triton.cdiv(D, block_d))](flat, g, part, N, D, g.stride(0), per_program, pad,
                                                             R=R, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4)
    sums = part[0] if programs == 1 else column_sums(part.view(1, programs, R * D), R * D).view(R, D)
    return sums[:num_weights]


def backward(grad: torch.Tensor, ids: torch.Tensor, num_weights: int, padding_idx=None) -> torch.Tensor:
    """``grad_weight`` [num_weights, D] in `grad`'s dtype of ``F.embedding(ids, weight, padding_idx)`` given the
    gradient `grad` [*ids.shape, D] of its output (module docstring). `ids`: integers in [0, num_weights)."""
    D = grad.shape[-1]
    if tuple(grad.shape[:-1]) != tuple(ids.shape):
        raise ValueError(f"grad, ids: expected grad of shape ids.shape + (D,), got {tuple(grad.shape)} for ids "
                         f"{tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids: expected int32 or int64, got {ids.dtype}")
    if not 0 < num_weights < 2 ** 31:
        raise ValueError(f"num_weights: expected a positive count below 2**31, got {num_weights}")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += num_weights
    flat = ids.reshape(-1)
    N = flat.numel()
    if N == 0 or D == 0:
        return torch.zeros(num_weights, D, device=grad.device, dtype=grad.dtype)
    g = grad.reshape(N, D)
    if g.stride(-1) != 1:
        g = g.contiguous()
    acc_dtype = torch.float64 if grad.dtype == torch.float64 else torch.float32
    pad = -1 if padding_idx is None else padding_idx
    if num_weights <= LAUNCH["small_table"]:
        return _small_table(g, flat.contiguous(), num_weights, pad, acc_dtype).to(grad.dtype)
    out = torch.zeros(num_weights, D, device=grad.device, dtype=grad.dtype)
    keys, order = torch.sort(flat.to(torch.int32), stable=True)
    part = torch.empty(N, D, device=grad.device, dtype=acc_dtype)
    chunk = LAUNCH["chunk"]
    chunks = triton.cdiv(N, chunk)
    _chunk_kernel[(chunks, triton.cdiv(D, LAUNCH["chunk_cols"]))](
        keys, order, g, part, out, N, D, g.stride(0), pad, CHUNK=chunk, BLOCK_D=LAUNCH["chunk_cols"], num_warps=4)
    if chunks > 1:
        _crossing_kernel[(chunks - 1, triton.cdiv(D, LAUNCH["row_cols"]))](
            keys, part, out, N, D, pad, CHUNK=chunk, BLOCK_D=LAUNCH["row_cols"], TILE=LAUNCH["tile"], num_warps=4)
    return out


def reference_backward(grad: torch.Tensor, ids: torch.Tensor, num_weights: int, padding_idx=None) -> torch.Tensor:
    """PyTorch's ``embedding_dense_backward`` (a negative `padding_idx` counted from the end, as ``F.embedding``
    counts it)."""
    pad = -1 if padding_idx is None else padding_idx % num_weights
    return torch.ops.aten.embedding_dense_backward(grad, ids, num_weights, pad, False)
