"""Helpers shared by the Triton launchers and kernels of cat_fast."""
import functools
import math

import torch
import triton
import triton.language as tl


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def partial_programs(n_rows: int, device, min_rows: int = 1, per_sm: float = 4) -> int:
    """How many programs share `n_rows` rows in the kernels that sum over rows (each program writes a row of
    partial sums, added by `column_sums.column_sums` afterwards): about `per_sm` per multiprocessor on a GPU (8 elsewhere), each
    with `min_rows` rows or more (fewer, longer runs on small inputs, so the partial sums stay small beside the
    data)."""
    target = max(1, int(per_sm * _multiprocessors(device.index if device.index is not None
                                                  else torch.cuda.current_device()))) if device.type == "cuda" else 8
    return max(1, min(-(-int(n_rows) // min_rows), target))


def runs(n_rows: int, tile: int, programs: int) -> tuple[int, int]:
    """``(programs, rows per program)`` when `n_rows` rows are shared by at most `programs` programs (as
    `partial_programs` says), each a run of whole `tile`s of rows: the run length rounded up to a tile, then the
    programs that have rows."""
    per_program = tile * -(-int(n_rows) // (tile * programs))
    return -(-int(n_rows) // per_program), per_program


def acc_tl_dtype(t: torch.Tensor):
    return tl.float64 if t.dtype == torch.float64 else tl.float32


def split_scalar(x: float):
    """Split a Python float into (hi, lo), both float32-representable, with hi + lo ~= x.

    Triton passes float arguments as float32; kernels rebuild the scalar in the accumulation dtype as
    ``float64(hi) + float64(lo)`` (~48 significant bits), so float64 kernels are not limited to
    float32 scalars. In float32 the sum rounds back to float32(x).
    """
    x = float(x)
    if math.isnan(x):
        return x, 0.0
    hi = float(torch.tensor(x, dtype=torch.float32))  # host-side Python float, no device involved
    if math.isinf(hi):
        return hi, 0.0
    lo = float(torch.tensor(x - hi, dtype=torch.float32))
    return hi, lo


def pow2_at_least(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def row_tiles(n_rows: int, n_cols: int, max_cols: int, tile_elems: int, max_rows: int = 1024):
    """(BLOCK_R, BLOCK_C): BLOCK_C = next pow2 of n_cols capped at max_cols; rows fill ~tile_elems."""
    block_c = min(pow2_at_least(n_cols), max_cols)
    block_r = max(1, min(tile_elems // block_c, pow2_at_least(n_rows), max_rows))
    return block_r, block_c


@triton.jit
def scalar_acc(hi, lo, ACC: tl.constexpr):
    """Rebuild a host scalar split by split_scalar, in the accumulation dtype."""
    return tl.cast(hi, ACC) + tl.cast(lo, ACC)


@triton.jit
def row_softmax_stats(base_ptr, rows, rmask, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                      ACC: tl.constexpr, NEED_ARGMAX: tl.constexpr):
    """Online per-row max m, sum s = sum_c exp(z_c - m) and (optionally) first argmax of a [*, C]
    row-major matrix, for the BLOCK_R rows `rows` (masked by rmask). Loops over C in BLOCK_C chunks.
    Rows outside rmask give finite garbage."""
    cols0 = tl.arange(0, BLOCK_C)
    roff = rows.to(tl.int64) * C
    m = tl.full([BLOCK_R], float("-inf"), ACC)
    s = tl.zeros([BLOCK_R], ACC)
    am = tl.zeros([BLOCK_R], tl.int32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + cols0
        cmask = cols < C
        x = tl.load(base_ptr + roff[:, None] + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(ACC)
        x = tl.where(cmask[None, :], x, float("-inf"))
        bm = tl.max(x, axis=1)
        if NEED_ARGMAX:
            bidx = tl.min(tl.where(x == bm[:, None], cols[None, :], C), axis=1)
            am = tl.where(bm > m, bidx, am)
        nm = tl.maximum(m, bm)
        s = s * tl.exp(m - nm) + tl.sum(tl.exp(x - nm[:, None]), axis=1)
        m = nm
    return m, s, am


# (device, stream) -> int32 completion counter of the one-launch reductions, see completion_counter
_counters = {}


def completion_counter(device: torch.device) -> torch.Tensor:
    """The int32 completion counter of a one-launch reduction (crm_loss, bias_loss): 0 before every launch (the
    launch's last program resets it), so one counter serves every such kernel launched on a stream.

    One per (device, stream): launches on one stream run in order, launches on different streams may
    overlap and must not share one. Made (zeroed) once, by a host copy rather than a fill, so that only its
    first use shows an extra op. During CUDA-graph capture a fresh zeroed counter is used instead: a
    captured fill only runs at replay, so a persistent counter made then would not be zeroed for eager calls.
    """
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return torch.zeros(1, dtype=torch.int32, device=device)
        key = (device.type, device.index, torch.cuda.current_stream(device).stream_id)
    else:
        key = (device.type, device.index, None)
    counter = _counters.get(key)
    if counter is None:
        counter = _counters.setdefault(key, torch.tensor([0], dtype=torch.int32, device=device))
    return counter


@triton.jit
def online_softmax(m, s, x):
    """Online max / sum of exp over one [R, BLOCK_C] chunk x (masked lanes -inf): (new max, rescaled sum)."""
    nm = tl.maximum(m, tl.max(x, axis=1))
    base = tl.where(nm == float("-inf"), 0.0, nm)  # rows all -inf so far: no (-inf) - (-inf)
    s = s * tl.exp(m - base) + tl.sum(tl.exp(x - base[:, None]), axis=1)
    return nm, s


@triton.jit
def labelled_rows(labels_ptr, tile, B, C, ignore_index, BLOCK_R: tl.constexpr):
    """Row tile `tile` of a [B, C] problem with labels: rows, rmask (rows < B), keep (in range and not ignored),
    yc (the label where kept, else 0: a safe column) and roff (each row's offset in a row-major [B, C] matrix)."""
    rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < B
    y = tl.load(labels_ptr + rows, mask=rmask, other=ignore_index)
    keep = rmask & (y != ignore_index)
    yc = tl.where(keep, y, 0)
    return rows, rmask, keep, yc, rows.to(tl.int64) * C


@triton.jit
def row_dots(x_ptr, xoff, y_ptr, yoff, rmask, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr):
    """Per row r (masked by rmask): Σ x·y, Σ x² and Σ y² over K columns, x's row starting at element xoff[r] of
    x_ptr and y's at yoff[r] of y_ptr."""
    xy = tl.zeros([BLOCK_R], ACC)
    xx = tl.zeros([BLOCK_R], ACC)
    yy = tl.zeros([BLOCK_R], ACC)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        m2 = rmask[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + xoff[:, None] + cols[None, :], mask=m2, other=0.0).to(ACC)
        y = tl.load(y_ptr + yoff[:, None] + cols[None, :], mask=m2, other=0.0).to(ACC)
        xy += tl.sum(x * y, axis=1)
        xx += tl.sum(x * x, axis=1)
        yy += tl.sum(y * y, axis=1)
    return xy, xx, yy


@triton.jit
def finish_partials(part_ptr, count_ptr, loss_ptr, denom_ptr, loss_part, denom_part, REDUCTION: tl.constexpr,
                    STORE_DENOM: tl.constexpr, BLOCK_P: tl.constexpr):
    """The end of a one-launch reduction over n programs: store this program's partials (float64; part_ptr[pid]
    the loss sum, REDUCTION 1 / 2 only, part_ptr[n + pid] the denominator); the program that increments the
    completion counter last adds them in a fixed order, writes the loss (REDUCTION 1: Σ loss / Σ denominator, NaN
    for 0 / 0; 2: Σ loss) and, STORE_DENOM, Σ denominator to denom_ptr, and resets the counter to 0."""
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    if REDUCTION != 0:
        tl.store(part_ptr + pid, loss_part)
    tl.store(part_ptr + n + pid, denom_part)
    tl.debug_barrier()  # the partials are stored before the (acq_rel) increment publishes them
    done = tl.atomic_add(count_ptr, 1)  # the old count
    if done == n - 1:
        offs = tl.arange(0, BLOCK_P)
        if STORE_DENOM or REDUCTION == 1:
            dparts = tl.load(part_ptr + n + offs, mask=offs < n, other=0.0, cache_modifier=".cg")
            dtot = tl.sum(dparts, axis=0)
        if STORE_DENOM:
            tl.store(denom_ptr, dtot.to(denom_ptr.dtype.element_ty))
        if REDUCTION != 0:
            parts = tl.load(part_ptr + offs, mask=offs < n, other=0.0, cache_modifier=".cg")
            tot = tl.sum(parts, axis=0)
            if REDUCTION == 1:
                tot = tot / dtot
            tl.store(loss_ptr, tot.to(loss_ptr.dtype.element_ty))
        tl.store(count_ptr, 0)  # ready for the next launch on this stream


@triton.jit
def tile_dot(a, b, DT: tl.constexpr, IEEE: tl.constexpr):
    """a @ b with the operands rounded to DT (the inputs' dtype: 16-bit tiles multiply as flash attention's do), at
    full precision for fp32; float64 as a broadcast product and sum (the tensor-core path of Triton has no
    float64 product of this size)."""
    if DT == tl.float64:
        return tl.sum(a.to(DT)[:, :, None] * b.to(DT)[None, :, :], axis=1)
    if IEEE:
        return tl.dot(a.to(DT), b.to(DT), input_precision="ieee")
    return tl.dot(a.to(DT), b.to(DT))
