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

`forward_with_dropout` also applies the branch's dropout itself: ``s = float(dropout(branch)) + residual``, the kept
values ``branch · scale`` rounded to the branch's dtype (as ``torch.native_dropout`` writes them), and returns the
keep mask (bool) the backward takes; the backwards' ``raw=True`` then recompute the sum from the branch before its
dropout the same way. The mask is a function of a 64-bit key (a `draw_key`, `varlen_attention`'s: drawn from the
device's PyTorch generator, so a CUDA graph redraws it at each replay and a generator set back to a state redraws
the same mask), a stream number and the element's place: element (r, c) of rows of D columns takes word ``c % 4`` of
the Philox-4x32-10 draw keyed by the key with counters ``(lo, hi, stream, 0)`` of the 64-bit number
``r·⌈D/4⌉+c//4``, and is dropped when that word (unsigned) is below ``t = round(p·2³²)`` (`reference_keep`): the
rate is p to 2⁻³². A row's mask does not depend on how many rows a call has.
"""
import torch
import triton
import triton.language as tl

from ._common import partial_programs, pow2_at_least, runs
from .column_sums import column_sums
from .varlen_attention import draw_key

__all__ = ["forward", "forward_with_dropout", "backward", "backward_with_params", "reference_forward",
           "reference_backward", "reference_backward_with_params", "reference_keep", "threshold",
           "draw_key"]


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
def _keep(key, rows, cols, D, threshold, stream):
    """[len(rows), len(cols)] bool: which elements of `rows` ([R] int64) and `cols` ([4·Q] int32, the columns 0..4Q)
    the dropout of `key` and `stream` keeps (module docstring)."""
    Q: tl.constexpr = cols.shape[0] // 4
    c = rows[:, None].to(tl.uint64) * ((D + 3) // 4) + tl.arange(0, Q)[None, :].to(tl.uint64)
    lo = c.to(tl.uint32)
    wide = c.to(tl.int64) * 0  # `stream` and `threshold` may arrive as Python ints (Triton specializes 1)
    r0, r1, r2, r3 = tl.philox(key, lo, (c >> 32).to(tl.uint32), (wide + stream).to(tl.uint32), lo * 0, 10)
    # join stacks along a new last axis: [R, Q, 2, 2] holds r0, r1, r2, r3 at 2·i + j of its last two
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [rows.shape[0], 4 * Q])
    return r.to(tl.int64) >= threshold  # threshold up to 2³², an int32 or int64 argument: compared in int64


@triton.jit
def _dropped(b, keep, scale, DT: tl.constexpr):
    """float32 of the branch's values `b` (float32 of its dtype DT) after the dropout: kept ones times `scale`
    rounded to DT, 0 elsewhere."""
    return tl.where(keep, (b * scale).to(DT).to(tl.float32), 0.0)


@triton.jit
def _forward_kernel(branch_ptr, residual_ptr, weight_ptr, bias_ptr, y_ptr, y16_ptr, mean_ptr, rstd_ptr, keep_ptr,
                    key_ptr, D, eps, threshold, scale, stream, BLOCK: tl.constexpr, WRITE16: tl.constexpr,
                    DROP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if DROP:
        cols = tl.arange(0, BLOCK)
        inside = cols < D
        base = row * D
        b = tl.load(branch_ptr + base + cols, mask=inside, other=0.0).to(tl.float32)
        keep = tl.reshape(_keep(tl.load(key_ptr), tl.full([1], 0, tl.int64) + row, cols, D, threshold, stream),
                          [BLOCK])
        tl.store(keep_ptr + base + cols, keep.to(tl.uint8), mask=inside)
        s = _dropped(b, keep, scale, branch_ptr.dtype.element_ty)
        s += tl.load(residual_ptr + base + cols, mask=inside, other=0.0).to(tl.float32)
    else:
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
def _tile_loads(grad_y_ptr, branch_ptr, residual_ptr, keep_ptr, mean_ptr, rstd_ptr, rows, end, cols, D, scale,
                HAS_KEEP: tl.constexpr, RAW: tl.constexpr):
    """The inputs of rows `rows` ([R] int64; those at or past `end` masked out), columns `cols`: (grad_y, s =
    branch + residual (RAW: the branch before its dropout, `_dropped`), keep (0 where there is none), mean, rstd),
    fp32 but keep, zero where masked."""
    inside = rows < end
    m = inside[:, None] & (cols < D)[None, :]
    offsets = rows[:, None] * D + cols[None, :]
    mean = tl.load(mean_ptr + rows, mask=inside, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=inside, other=0.0)
    if HAS_KEEP:
        keep = tl.load(keep_ptr + offsets, mask=m, other=0)
    else:
        keep = tl.zeros_like(offsets).to(tl.uint8)
    s = tl.load(branch_ptr + offsets, mask=m, other=0.0).to(tl.float32)
    if RAW:
        s = _dropped(s, keep != 0, scale, branch_ptr.dtype.element_ty)
    s += tl.load(residual_ptr + offsets, mask=m, other=0.0).to(tl.float32)
    grad_y = tl.load(grad_y_ptr + offsets, mask=m, other=0.0).to(tl.float32)
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
                    rows, n_rows, cols, w, D, scale, HAS_KEEP: tl.constexpr, RAW: tl.constexpr):
    """The backward of the rows `rows` ([R] int64; those at or past `n_rows` masked out), columns `cols`: stores
    grad_s (fp32) and grad_branch (in its dtype); returns (grad_y, x_hat, grad_branch as rounded), [R, BLOCK] in
    fp32, zero where masked."""
    grad_y, s, keep, mean, rstd = _tile_loads(grad_y_ptr, branch_ptr, residual_ptr, keep_ptr, mean_ptr, rstd_ptr,
                                              rows, n_rows, cols, D, scale, HAS_KEEP, RAW)
    x_hat, rounded = _tile_compute(grad_y, s, keep, mean, rstd, grad_s_ptr, grad_branch_ptr, rows, n_rows, cols, w,
                                   D, scale, HAS_KEEP)
    return grad_y, x_hat, rounded


@triton.jit
def _backward_kernel(grad_y_ptr, branch_ptr, residual_ptr, weight_ptr, mean_ptr, rstd_ptr, keep_ptr, grad_s_ptr,
                     grad_branch_ptr, n_rows, D, scale, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                     HAS_KEEP: tl.constexpr, RAW: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    w = tl.load(weight_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    _tile_gradients(grad_y_ptr, branch_ptr, residual_ptr, keep_ptr, grad_s_ptr, grad_branch_ptr, mean_ptr, rstd_ptr,
                    rows, n_rows, cols, w, D, scale, HAS_KEEP, RAW)


@triton.jit
def _backward_params_kernel(grad_y_ptr, branch_ptr, residual_ptr, weight_ptr, mean_ptr, rstd_ptr, keep_ptr,
                            grad_s_ptr, grad_branch_ptr, part_ptr, n_rows, D, rows_per_program, n_programs, scale,
                            ROWS: tl.constexpr, BLOCK: tl.constexpr, HAS_KEEP: tl.constexpr,
                            RAW: tl.constexpr, PREFETCH: tl.constexpr):
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
                                                  rstd_ptr, rows, end, cols, D, scale, HAS_KEEP, RAW)
        for start in range(0, rows_per_program, ROWS):
            following = rows + ROWS
            grad_y_n, s_n, keep_n, mean_n, rstd_n = _tile_loads(grad_y_ptr, branch_ptr, residual_ptr, keep_ptr,
                                                                mean_ptr, rstd_ptr, following, end, cols, D,
                                                                scale, HAS_KEEP, RAW)
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
                                                     scale, HAS_KEEP, RAW)
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


def threshold(p: float) -> int:
    """The dropout's threshold for drop probability `p` in [0, 1): ``round(p · 2³²)`` (the drawn word, unsigned, is
    dropped below it)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"residual_layer_norm: the dropout probability p={p!r} must lie in [0, 1)")
    return min(round(p * 2.0 ** 32), 2 ** 32 - 1)


def _forward(branch, residual, weight, bias, eps, out16_dtype, drop):
    D = weight.numel()
    b, r = _rows(branch, D), _rows(residual, D)
    n = b.shape[0]
    y = torch.empty(n, D, device=b.device, dtype=torch.float32)
    y16 = torch.empty(n, D, device=b.device, dtype=out16_dtype) if out16_dtype is not None else y
    mean = torch.empty(n, device=b.device, dtype=torch.float32)
    rstd = torch.empty(n, device=b.device, dtype=torch.float32)
    keep = torch.empty(n, D, device=b.device, dtype=torch.bool) if drop is not None else None
    p, key, stream = drop if drop is not None else (0.0, None, 0)
    if n:
        block = pow2_at_least(max(D, 4))
        _forward_kernel[(n,)](b, r, weight.contiguous(), bias.contiguous(), y, y16, mean, rstd,
                              keep.view(torch.uint8) if drop is not None else y, key if drop is not None else y, D,
                              float(eps), threshold(p), 1.0 / (1.0 - p), int(stream), BLOCK=block,
                              WRITE16=out16_dtype is not None, DROP=drop is not None,
                              num_warps=4 if block <= 2048 else 8)
    shape = tuple(residual.shape)
    return (y.view(shape), (y16.view(shape) if out16_dtype is not None else None), mean, rstd,
            keep.view(shape) if keep is not None else None)


def forward(branch, residual, weight, bias, eps, out16_dtype=None):
    """``(y fp32, y in out16_dtype or None, mean, rstd)`` for ``y = LayerNorm(branch + residual)``; all inputs on
    one CUDA device, rows of length ``D = weight.numel()``."""
    return _forward(branch, residual, weight, bias, eps, out16_dtype, None)[:4]


def forward_with_dropout(branch, residual, weight, bias, eps, p, key, stream=0, out16_dtype=None):
    """``(y fp32, y in out16_dtype or None, mean, rstd, keep)`` for ``y = LayerNorm(dropout(branch) + residual)``,
    the dropout drawn here (module docstring): drop probability `p` in [0, 1), `key` an int64 [1] tensor on the
    device (`draw_key`), `stream` in [0, 2³²) (one key serves several dropouts by their streams);
    `keep` bool, `residual`'s shape. The backwards take `branch` with ``raw=True``, `keep` and ``1 / (1 - p)``."""
    if not (isinstance(key, torch.Tensor) and key.dtype == torch.int64 and key.numel() == 1
            and key.device == branch.device):
        raise ValueError("residual_layer_norm.forward_with_dropout: key must be an int64 tensor of one element on "
                         f"the branch's device ({branch.device}), got {key!r}")
    if not 0 <= int(stream) < 2 ** 32:
        raise ValueError(f"residual_layer_norm.forward_with_dropout: stream={stream!r} must lie in [0, 2³²)")
    return _forward(branch, residual, weight, bias, eps, out16_dtype, (p, key, stream))


def _raw_keep(raw, keep):
    if raw and keep is None:
        raise ValueError("residual_layer_norm: raw=True (the branch before its dropout) needs the keep mask")


def backward(grad_y, branch, residual, weight, mean, rstd, keep, scale, *, raw=False, rows=None, num_warps=None):
    """``(grad_s fp32, grad_branch in branch's dtype)``; `keep` is the dropout mask (bool) or None, `scale` its
    rescale factor ``1 / (1 - p)`` (1 without dropout); `raw`: `branch` is the branch before its dropout
    (`forward_with_dropout`'s), else after it. `rows`, `num_warps`: launch settings (rows per program; `LAUNCH` by
    default), for the benchmarks."""
    _raw_keep(raw, keep)
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
                                                  RAW=raw, num_warps=num_warps or _warps(block, rows))
    shape = tuple(residual.shape)
    return grad_s.view(shape), grad_branch.view(shape)


def backward_with_params(grad_y, branch, residual, weight, mean, rstd, keep, scale, *, raw=False, rows=None,
                         min_rows=None, per_sm=None, num_warps=None, prefetch=None):
    """``(grad_s fp32, grad_branch in branch's dtype, grad_weight, grad_bias, grad_branch_bias)``: `backward`'s two
    gradients and the sums over the rows of ``grad_y * x_hat`` (the LayerNorm weight's gradient), ``grad_y`` (its
    bias's) and ``grad_branch`` as rounded to the branch's dtype (the gradient of a bias added to the branch
    before its dropout), all three in fp32 (views of one [3, D] buffer); `raw` as for `backward`. `rows` (per
    iteration), `min_rows` (per program), `per_sm` (programs per multiprocessor), `num_warps`, `prefetch` (each
    iteration loads the next rows before its arithmetic): launch settings (`LAUNCH` by default), for the
    benchmarks."""
    _raw_keep(raw, keep)
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
                                         HAS_KEEP=keep is not None, RAW=raw,
                                         PREFETCH=bool(LAUNCH["params_prefetch"] if prefetch is None else prefetch),
                                         num_warps=num_warps or LAUNCH["params_warps"] or _warps(block, rows))
    sums = column_sums(part, D)
    shape = tuple(residual.shape)
    return grad_s.view(shape), grad_branch.view(shape), sums[0], sums[1], sums[2]


def _reference_sum(branch, residual, keep, scale, raw):
    acc = torch.promote_types(residual.dtype, torch.float32)
    if raw:  # the kept values scaled and rounded to the branch's dtype, as the dropout writes them
        branch = torch.where(keep, (branch.to(acc) * scale).to(branch.dtype), 0)
    return acc, branch.to(acc) + residual.to(acc)


def reference_keep(key: int, rows: int, D: int, p: float, stream: int = 0, first_row: int = 0) -> torch.Tensor:
    """`forward_with_dropout`'s keep mask of rows ``first_row .. first_row + rows`` for the key's value `key`, in
    Python integers (Philox-4x32-10, module docstring): bool [rows, D] on the CPU. Slow: for tests."""
    M = 0xFFFFFFFF
    k0, k1 = key & M, (key >> 32) & M
    t = threshold(p)
    out = torch.empty(rows, D, dtype=torch.bool)
    words = -(-D // 4)
    for r in range(rows):
        for q in range(words):
            c = (first_row + r) * words + q
            c0, c1, c2, c3, a, b = c & M, c >> 32, stream, 0, k0, k1
            for _ in range(10):
                p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
                c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ a) & M, p1 & M, ((p0 >> 32) ^ c3 ^ b) & M, p0 & M
                a, b = (a + 0x9E3779B9) & M, (b + 0xBB67AE85) & M
            for j, word in enumerate((c0, c1, c2, c3)):
                if 4 * q + j < D:
                    out[r, 4 * q + j] = word >= t
    return out


def reference_forward(branch, residual, weight, bias, eps, out16_dtype=None, keep=None, scale=1.0):
    """The same in PyTorch ops (statistics in float32, or float64 for float64 inputs); with `keep` and `scale`, of
    `forward_with_dropout` (`branch` before its dropout)."""
    acc, s = _reference_sum(branch, residual, keep, scale, keep is not None)
    mean = s.mean(-1)
    centred = s - mean.unsqueeze(-1)
    rstd = torch.rsqrt(centred.square().mean(-1) + eps)
    y = centred * rstd.unsqueeze(-1) * weight.to(acc) + bias.to(acc)
    return y, (y.to(out16_dtype) if out16_dtype is not None else None), mean.reshape(-1), rstd.reshape(-1)


def reference_backward(grad_y, branch, residual, weight, mean, rstd, keep, scale, raw=False):
    acc, s = _reference_sum(branch, residual, keep, scale, raw)
    shape = s.shape
    mean, rstd = mean.view(*shape[:-1], 1), rstd.view(*shape[:-1], 1)
    x_hat = (s - mean) * rstd
    g_hat = grad_y.to(acc) * weight.to(acc)
    grad_s = (g_hat - x_hat * (x_hat * g_hat).mean(-1, keepdim=True) - g_hat.mean(-1, keepdim=True)) * rstd
    grad_branch = grad_s * scale
    if keep is not None:
        grad_branch = torch.where(keep, grad_branch, 0.0)
    return grad_s, grad_branch.to(branch.dtype)


def reference_backward_with_params(grad_y, branch, residual, weight, mean, rstd, keep, scale, raw=False):
    """`backward_with_params` in PyTorch ops."""
    grad_s, grad_branch = reference_backward(grad_y, branch, residual, weight, mean, rstd, keep, scale, raw)
    acc, s = _reference_sum(branch, residual, keep, scale, raw)
    x_hat = (s - mean.view(*s.shape[:-1], 1)) * rstd.view(*s.shape[:-1], 1)
    rows = grad_y.to(acc).reshape(-1, s.shape[-1])
    return (grad_s, grad_branch, (rows * x_hat.reshape(rows.shape)).sum(0), rows.sum(0),
            grad_branch.reshape(rows.shape).to(acc).sum(0))
