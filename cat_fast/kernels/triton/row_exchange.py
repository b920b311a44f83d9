"""The average over two GPUs of a gradient whose rows are mostly zero (an embedding table's: only the rows of the ids
a batch holds are not), for `cat_fast.gradient_averaging`'s copy exchange: each rank reads across the link only the
rows that are not zero on the other rank, rather than the whole table.

- `mark(grad, stage, flags)`: ``flags[v] = 1`` where row v of `grad` has an element that is not zero (NaN
  included), else 0; those rows are copied to `stage`. The other rows of `stage` are not written (never read).
- `combine(grad, peer_stage, peer_flags, out, scale)`: ``out[v] = grad[v]·scale + peer_stage[v]·scale`` where
  ``peer_flags[v]``, else ``grad[v]·scale + 0``, where `peer_stage` and `peer_flags` are the other rank's `mark`
  outputs, read in place (PyTorch's symmetric memory). With ``scale = 1/2`` both products are exact, so this is the
  all-reduce of the two ranks' shares scaled by 1/2 (DDP's), to the bit (a row that is zero on the other rank adds
  zero), and both ranks get the same bits (the sum of two terms is the same in either order).

Both work in fp32 (float64 for float64 tables) and store in the table's dtype; the products and the sum are rounded
separately (no fused multiply-add), as the all-reduce rounds them. `reference` is the plain composition.
"""
import torch
import triton
import triton.language as tl

from ._common import acc_tl_dtype, pow2_at_least

__all__ = ["mark", "combine", "reference", "LAUNCH"]

# rows per program of both kernels, and columns per tile (at most)
LAUNCH = {"rows": 8, "cols": 1024}


@triton.jit
def _mark_kernel(grad_ptr, stage_ptr, flags_ptr, V, H, stride_grad, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    inside = rows < V
    base = grad_ptr + rows.to(tl.int64)[:, None] * stride_grad
    seen = tl.zeros([BLOCK_R], dtype=tl.int32)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        m = inside[:, None] & (cols < H)[None, :]
        g = tl.load(base + cols[None, :], mask=m, other=0.0)
        seen = tl.maximum(seen, tl.max((g != 0).to(tl.int32), axis=1))
    tl.store(flags_ptr + rows, seen.to(flags_ptr.dtype.element_ty), mask=inside)
    keep = inside & (seen != 0)
    out = stage_ptr + rows.to(tl.int64)[:, None] * H
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        m = keep[:, None] & (cols < H)[None, :]
        tl.store(out + cols[None, :], tl.load(base + cols[None, :], mask=m), mask=m)


@triton.jit
def _combine_kernel(grad_ptr, peer_stage_ptr, peer_flags_ptr, out_ptr, V, H, stride_grad, scale,
                    ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    inside = rows < V
    m = inside[:, None] & (cols < H)[None, :]
    peer = tl.load(peer_flags_ptr + rows, mask=inside, other=0.0) != 0
    r64 = rows.to(tl.int64)[:, None]
    g = tl.load(grad_ptr + r64 * stride_grad + cols[None, :], mask=m, other=0.0).to(ACC)
    p = tl.load(peer_stage_ptr + r64 * H + cols[None, :], mask=m & peer[:, None], other=0.0).to(ACC)
    tl.store(out_ptr + r64 * H + cols[None, :], (g * scale + p * scale).to(out_ptr.dtype.element_ty), mask=m)


def _checked(name, t, like):
    if t.dim() != 2 or t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(f"{name}: expected a {tuple(like.shape)} {like.dtype} tensor on {like.device}, got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if t.stride(1) != 1:
        raise ValueError(f"{name}: expected contiguous rows (stride 1 along them), got strides {t.stride()}")


def _flags_checked(name, flags, grad):
    if flags.shape != (grad.shape[0],) or flags.dtype != grad.dtype or flags.device != grad.device:
        raise ValueError(f"{name}: expected a ({grad.shape[0]},) {grad.dtype} tensor on {grad.device}, got "
                         f"{tuple(flags.shape)} {flags.dtype} on {flags.device}")


def _tiles(H):
    return LAUNCH["rows"], min(pow2_at_least(H), LAUNCH["cols"])


def mark(grad: torch.Tensor, stage: torch.Tensor, flags: torch.Tensor) -> None:
    """Flags the rows of `grad` ([V, H], rows contiguous) that are not all zero and copies them to `stage` (a
    contiguous [V, H] of its dtype); `flags` ([V], the same dtype): 1 or 0 per row."""
    if grad.dim() != 2:
        raise ValueError(f"grad: expected a 2-D table gradient, got shape {tuple(grad.shape)}")
    _checked("stage", stage, grad)
    _flags_checked("flags", flags, grad)
    if grad.stride(1) != 1 or not stage.is_contiguous() or not flags.is_contiguous():
        raise ValueError("mark: expected grad's rows, stage and flags contiguous")
    V, H = grad.shape
    if V == 0:
        return
    BLOCK_R, BLOCK_H = _tiles(H)
    _mark_kernel[(triton.cdiv(V, BLOCK_R),)](grad, stage, flags, V, H, grad.stride(0), BLOCK_R=BLOCK_R,
                                             BLOCK_H=BLOCK_H)


def combine(grad: torch.Tensor, peer_stage: torch.Tensor, peer_flags: torch.Tensor, out: torch.Tensor,
            scale: float) -> None:
    """``out = grad·scale + peer·scale``, where peer is `peer_stage`'s row where `peer_flags` is set and zero
    elsewhere (module docstring). `out` may be `grad` itself."""
    _checked("peer_stage", peer_stage, grad)
    _checked("out", out, grad)
    _flags_checked("peer_flags", peer_flags, grad)
    if not (peer_stage.is_contiguous() and out.is_contiguous() and peer_flags.is_contiguous()):
        raise ValueError("combine: expected peer_stage, peer_flags and out contiguous")
    V, H = grad.shape
    if V == 0 or H == 0:
        return
    BLOCK_R, BLOCK_H = _tiles(H)
    grid = (triton.cdiv(V, BLOCK_R), triton.cdiv(H, BLOCK_H))
    _combine_kernel[grid](grad, peer_stage, peer_flags, out, V, H, grad.stride(0), float(scale),
                          ACC=acc_tl_dtype(grad), BLOCK_R=BLOCK_R, BLOCK_H=BLOCK_H, enable_fp_fusion=False)


def reference(grad, peer_grad, scale):
    """The all-reduce of the two ranks' scaled shares: ``grad·scale + peer_grad·scale``, in the accumulation dtype."""
    acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
    return (grad.to(acc) * scale + peer_grad.to(acc) * scale).to(grad.dtype)
