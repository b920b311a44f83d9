"""Attention of one query per sequence: the first-token layer's (`layers.first_token`), where only row 0 reads the
keys and values of every token.

``first_row(q, keys_values, mask, heads, dropout_p, scale)`` is ``F.scaled_dot_product_attention`` of the heads of
``q [B, 1, H*D]`` over ``keys_values`` (a pair ``(k, v)`` of ``[B, T, H*D]`` tensors, or one ``[B, T, 2*H*D]``
tensor holding keys then values), returned as ``[B, 1, H*D]``. On CUDA with Triton (`FUSED`) it is one kernel
each way (`kernels.triton.first_row_attention`), in place of SDPA's memory-efficient kernels, which SDPA picks for
one query with a mask and which are several times slower on this shape (benchmarks/RESULTS.md, "The first-token
layer's attention"). Elsewhere, and for what the kernel does not take (a mask of another shape or with a
gradient, mixed dtypes), it is SDPA itself.

Attention dropout: the kernel path draws its keep mask with ``torch.Tensor.bernoulli_`` (one uint8 per
(sequence, head, key), from torch's generator, so CUDA-graph safe) instead of inside SDPA's kernel: the same
distribution, other draws than SDPA's for the same seed. (The first-token layer's draws were never the full
layer's row 0: SDPA draws per call shape.) `fused_first_row` takes the keep mask explicitly (the tests compare it
with a plain composition).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..ops.fused import fused_kernels

__all__ = ["first_row", "first_row_packed", "fused_first_row", "fused_first_row_packed", "score_bias", "keep_mask",
           "FUSED"]

# Whether CUDA passes use the fused kernel (module docstring); off: SDPA.
FUSED = True

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _split(keys_values, width):
    if isinstance(keys_values, torch.Tensor):
        return keys_values[..., :width], keys_values[..., width:]
    return keys_values


class _FirstRow(torch.autograd.Function):
    """``(q, k or the packed kv, v or None, bias, keep, heads, scale, inv_keep) -> out``; gradients for q and
    the keys and values (one ``[B, T, 2*H*D]`` gradient for a packed kv). Not twice differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, bias, keep, heads, scale, inv_keep, rows=None):
        kernels = fused_kernels("first_row_attention")
        packed = v is None
        if packed:
            k, v = _split(k, q.shape[-1])
        out, saved = kernels.forward(q, k, v, bias, keep, heads, scale, inv_keep, rows)
        ctx.save_for_backward(q, k, v, keep, *saved)
        ctx.heads, ctx.scale, ctx.inv_keep, ctx.packed, ctx.rows = heads, scale, inv_keep, packed, rows
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, v, keep, *saved = ctx.saved_tensors
        kernels = fused_kernels("first_row_attention")
        dk = dv = grad_kv = None
        if ctx.packed:
            HD = k.shape[-1]
            new = torch.empty if ctx.rows is None else torch.zeros  # packed rows: the kernel writes the keys' only
            grad_kv = new(*k.shape[:-1], 2 * HD, device=k.device, dtype=k.dtype)
            dk, dv = grad_kv[..., :HD], grad_kv[..., HD:]
        dq, dk, dv = kernels.backward(grad, q, k, v, keep, saved, ctx.heads, ctx.scale, ctx.inv_keep, dk, dv,
                                      ctx.rows)
        if ctx.packed:
            return dq, grad_kv, None, None, None, None, None, None, None
        return dq, dk, dv, None, None, None, None, None, None


def score_bias(mask, B, H, T, device):
    """The mask as an additive ``[B, H, T]`` score bias (broadcast strides), or False where the kernel does not
    take it (then SDPA runs)."""
    if mask is None:
        return None
    if (mask.dim() != 4 or mask.shape[2] != 1 or mask.shape[3] != T or mask.shape[0] not in (1, B)
            or mask.shape[1] not in (1, H) or mask.requires_grad or mask.device != device):
        return False
    bias = mask[:, :, 0]
    if bias.dtype == torch.bool:
        bias = torch.zeros(bias.shape, device=device).masked_fill_(~bias, float("-inf"))
    return bias.expand(B, H, T)


def _checked(q, k, v, heads):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3 or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a 3-D tensor with unit column stride, got shape {tuple(t.shape)} and "
                             f"strides {t.stride()}")
    B, T, HD = k.shape
    if q.shape != (B, 1, HD) or v.shape != (B, T, HD) or HD % heads:
        raise ValueError(f"expected q [B, 1, H*D] and k, v [B, T, H*D] with H = heads = {heads}, got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if B == 0 or T == 0:
        raise ValueError(f"k, v: expected at least one sequence and one key, got shape {tuple(k.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise ValueError(f"q, k, v: expected one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def fused_first_row(q, keys_values, bias, heads: int, keep, scale: float, dropout_p: float = 0.0):
    """The kernel path of `first_row`, on any device Triton runs on (the interpreter on the CPU): `bias` None or an
    additive score bias broadcastable to ``[B, H, T]`` (``[B|1, H|1, T]``), `keep` None or a ``[B, H, T]`` keep
    mask (nonzero = kept; the kept probabilities are divided by ``1 - dropout_p``)."""
    packed = isinstance(keys_values, torch.Tensor)
    if packed and (keys_values.dim() != 3 or keys_values.shape[-1] != 2 * q.shape[-1]):
        raise ValueError(f"keys_values: expected [B, T, 2*H*D] with H*D = {q.shape[-1]} (q's width), got "
                         f"{tuple(keys_values.shape)}")
    k, v = _split(keys_values, q.shape[-1])
    _checked(q, k, v, heads)
    B, T, _ = k.shape
    if bias is not None:
        bias = bias.expand(B, heads, T)
    if keep is not None:
        keep = keep.reshape(B, heads, T).to(torch.uint8).contiguous()
    inv_keep = 1.0 / (1.0 - dropout_p)
    return _FirstRow.apply(q, keys_values if packed else k, None if packed else v, bias, keep, heads, scale,
                           inv_keep)


def _sdpa(q, k, v, mask, heads, dropout_p, scale):
    B, T, HD = k.shape
    D = HD // heads
    context = F.scaled_dot_product_attention(q.view(B, 1, heads, D).transpose(1, 2),
                                             k.view(B, T, heads, D).transpose(1, 2),
                                             v.view(B, T, heads, D).transpose(1, 2),
                                             attn_mask=mask, dropout_p=dropout_p, scale=scale)
    return context.transpose(1, 2).reshape(B, 1, HD)


def first_row(q, keys_values, mask, heads: int, dropout_p: float, scale: float):
    """SDPA of one query per sequence (module docstring): `mask` as SDPA takes it (bool: True attends; float:
    added to the scores), broadcastable to ``[B, H, 1, T]``."""
    k, v = _split(keys_values, q.shape[-1])
    B, T, HD = k.shape
    fused = (FUSED and q.is_cuda and q.dtype == k.dtype == v.dtype and q.dtype in _DTYPES and _autocast_keeps(q)
             and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and 0.0 <= dropout_p < 1.0 and B * T > 0)
    bias = score_bias(mask, B, heads, T, q.device) if fused else False
    if bias is False or fused_kernels("first_row_attention") is None:
        return _sdpa(q, k, v, mask, heads, dropout_p, scale)
    return fused_first_row(q, keys_values, bias, heads, keep_mask(B, heads, T, q.device, dropout_p), scale,
                           dropout_p)


def _autocast_keeps(q) -> bool:
    """Whether the kernel computes what SDPA would: under autocast SDPA computes in autocast's dtype, so the kernel
    runs only where the inputs already have it."""
    return not torch.is_autocast_enabled("cuda") or q.dtype in (torch.get_autocast_dtype("cuda"), torch.float64)


def _checked_packed(q, keys_values, rows, heads, real=None):
    B, HD = q.shape[0], q.shape[-1]
    seq, key_rows, positions, T = rows
    if (q.dim() != 3 or q.shape[1] != 1 or B == 0 or keys_values.dim() != 2 or keys_values.shape[0] == 0
            or keys_values.shape[1] != 2 * HD or HD % heads or seq.shape != (B + 1,)
            or positions.shape != (keys_values.shape[0],) or (real is not None and real.shape != (B, T))):
        raise ValueError(f"first_row_packed: expected q [B, 1, H*D] (B >= 1), keys_values [N, 2*H*D] (N >= 1), "
                         f"seq [B+1], positions [N] and real [B, T] with H = heads = {heads}, got q {tuple(q.shape)}, "
                         f"keys_values {tuple(keys_values.shape)}, seq {tuple(seq.shape)}, positions "
                         f"{tuple(positions.shape)}, real {None if real is None else tuple(real.shape)}, T = {T}")
    if q.stride(-1) != 1 or keys_values.stride(-1) != 1:
        raise ValueError("q, keys_values: expected unit column strides")
    if q.dtype != keys_values.dtype or q.dtype not in _DTYPES:
        raise ValueError(f"q, keys_values: expected one floating dtype, got {q.dtype}, {keys_values.dtype}")


def first_row_packed(q, keys_values, rows, real, heads: int, dropout_p: float, scale: float):
    """`first_row` over packed keys: `keys_values` ``[N, 2*H*D]`` (keys then values) of the packed rows of the B
    sequences whose queries `q` ``[B, 1, H*D]`` are; `rows` = ``(seq, key_rows, positions, T)`` as
    `kernels.triton.first_row_attention` takes them (`layers.packing.Plan.first_row_keys`); `real` the ``[B, T]``
    key mask of the padded layout. The kernel where `first_row` runs it (drawing the same keep mask: the padded
    call's draws for the same keys); elsewhere the keys and values put back in a zero ``[B, T, 2*H*D]`` layout
    and `first_row` over it with `real` as the mask. Not twice differentiable on the kernel path."""
    _checked_packed(q, keys_values, rows, heads, real)
    B, HD, T, positions = q.shape[0], q.shape[-1], rows[3], rows[2]
    fused = (FUSED and q.is_cuda and _autocast_keeps(q) and 0.0 <= dropout_p < 1.0
             and fused_kernels("first_row_attention") is not None)  # shapes, dtypes, strides: checked above
    if not fused:
        full = keys_values.new_zeros(B * T, 2 * HD).index_copy(0, positions, keys_values).view(B, T, 2 * HD)
        return first_row(q, full, real.view(B, 1, 1, T), heads, dropout_p, scale)
    return fused_first_row_packed(q, keys_values, rows, heads, keep_mask(B, heads, T, q.device, dropout_p), scale,
                                  dropout_p)


def fused_first_row_packed(q, keys_values, rows, heads: int, keep, scale: float, dropout_p: float = 0.0):
    """The kernel path of `first_row_packed`, on any device Triton runs on (the interpreter on the CPU): `keep` None
    or a ``[B, H, T]`` keep mask over the padded layout's positions (nonzero = kept)."""
    _checked_packed(q, keys_values, rows, heads)
    B, T = q.shape[0], rows[3]
    if keep is not None:
        keep = keep.reshape(B, heads, T).to(torch.uint8).contiguous()
    return _FirstRow.apply(q, keys_values, None, None, keep, heads, scale, 1.0 / (1.0 - dropout_p), rows)


def keep_mask(B: int, heads: int, T: int, device, dropout_p: float):
    """The kernel path's attention-dropout keep mask: a uint8 ``[B, heads, T]`` Bernoulli(1 - `dropout_p`) draw
    from torch's generator, or None without dropout."""
    if dropout_p <= 0.0:
        return None
    return torch.empty(B, heads, T, device=device, dtype=torch.uint8).bernoulli_(1.0 - dropout_p)
