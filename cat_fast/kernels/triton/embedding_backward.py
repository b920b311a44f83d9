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

The sums run in fp32 (float64 for float64 gradients) in an order that the ids and the launch settings fix, with no
atomic additions: the same bits on every run. `reference_backward` is PyTorch's.
"""
import torch
import triton
import triton.language as tl

__all__ = ["backward", "reference_backward", "LAUNCH"]

# sorted entries per program of the first launch (a power of 2), columns per program of each, and partial rows the
# second adds per iteration
LAUNCH = {"chunk": 64, "chunk_cols": 128, "row_cols": 128, "tile": 64}


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
    x = tl.load(grad_ptr + rows[:, None] * stride_grad + cols[None, :], mask=valid[:, None] & inside[None, :],
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
    out = torch.zeros(num_weights, D, device=grad.device, dtype=grad.dtype)
    flat = ids.reshape(-1)
    N = flat.numel()
    if N == 0 or D == 0:
        return out
    g = grad.reshape(N, D)
    if g.stride(-1) != 1:
        g = g.contiguous()
    keys, order = torch.sort(flat.to(torch.int32), stable=True)
    part = torch.empty(N, D, device=grad.device, dtype=torch.float64 if grad.dtype == torch.float64
                       else torch.float32)
    chunk, pad = LAUNCH["chunk"], -1 if padding_idx is None else padding_idx
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
