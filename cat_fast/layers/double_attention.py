"""Attention whose backward is itself differentiable, without eager attention: what exact gradient supervision at the
token states needs, a double backward through every layer's attention.

``attention(q, k, v, mask=None, dropout_p=0.0, scale=None)`` is ``F.scaled_dot_product_attention`` of ``q [B, H,
TQ, D]`` over ``k``, ``v`` ``[B, H, TK, D]``, returned as the head view of a token-major ``[B, TQ, H, D]`` buffer.
On CUDA with Triton (and on the CPU under the Triton interpreter) it is the kernels of
`cat_fast.kernels.triton.attention`: a tiled forward, backward and double backward, none of which writes a ``[T,
T]`` tensor of scores, so that what the double backward keeps is the inputs, the output and two numbers per row.
Elsewhere it is `reference`, the plain composition of the formula, which autograd differentiates twice. `mask`:
None, bool (True attends) or an additive float bias, broadcastable to ``[B, H, TQ, TK]``, without a gradient.
Attention dropout draws a uint8 keep mask ``[B, H, TQ, TK]`` with ``torch.Tensor.bernoulli_`` (torch's generator:
CUDA-graph safe), one byte per score that the backward passes re-read.

`NAME` is this attention as a Hugging Face attention implementation (`register` registers it and SDPA's mask for
it); ``with installed(model):`` runs the model's attention modules on it, whatever implementation they were loaded
with. Exact `GradientSupervision` at the token states does so on CUDA (`objectives.gs`).
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from ..ops.fused import fused_kernels

__all__ = ["attention", "reference", "NAME", "register", "installed", "hf_attention", "available"]

NAME = "cat_fast_double"

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _kernels():
    return fused_kernels("attention")


def available(device) -> bool:
    """Whether `attention` runs the kernels for tensors on `device` (CUDA with Triton, or the Triton interpreter)."""
    device = torch.device(device)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return (device.type == "cuda" or interpreted) and _kernels() is not None


def second_order_only(backward):
    """A double backward that runs without a graph and refuses one: under ``create_graph=True`` (a third
    derivative) it raises. PyTorch's ``once_differentiable`` raises only where the engine visits its error node,
    which ``torch.autograd.grad(..., inputs)`` prunes: a third derivative would silently miss these terms."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(f"{type(ctx).__name__.removesuffix('Backward')}: the fused double backward cannot be "
                               "differentiated again (create_graph=True); run without the fused layers for a "
                               "third derivative")
        return backward(ctx, *grads)

    return wrapper


class _Attention(torch.autograd.Function):
    """``(q, k, v, bias, keep, span, scale, inv_keep) -> out``; its backward is `_AttentionGrad`, differentiable
    again. `span`: the kernels' ``key_span(bias)``."""

    @staticmethod
    def forward(ctx, q, k, v, bias, keep, span, scale, inv_keep):
        out, stats = _kernels().forward(q, k, v, bias, keep, span, scale, inv_keep)
        ctx.save_for_backward(q, k, v, out)
        ctx.stats, ctx.bias, ctx.keep, ctx.span, ctx.scale, ctx.inv_keep = stats, bias, keep, span, scale, inv_keep
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out = ctx.saved_tensors
        dq, dk, dv = _AttentionGrad.apply(q, k, v, out, _kernels().token_major(do), ctx.stats, ctx.bias, ctx.keep,
                                          ctx.span, ctx.scale, ctx.inv_keep)
        return dq, dk, dv, None, None, None, None, None


class _AttentionGrad(torch.autograd.Function):
    """``(q, k, v, out, do, ...) -> (dq, dk, dv)``, the attention's backward; its own backward is the double
    backward kernel pair. ``out`` enters only through Δ = rowsum(do∘out), which the double backward differentiates
    as rowsum(P∘dP) (the same number): out gets no gradient of its own."""

    @staticmethod
    def forward(ctx, q, k, v, out, do, stats, bias, keep, span, scale, inv_keep):
        kernels = _kernels()
        dl = kernels.delta(do, out)
        dq, dk, dv = kernels.backward(do, q, k, v, stats, dl, bias, keep, span, scale, inv_keep)
        ctx.save_for_backward(q, k, v, do)
        ctx.stats, ctx.dl, ctx.bias, ctx.keep, ctx.span = stats, dl, bias, keep, span
        ctx.scale, ctx.inv_keep = scale, inv_keep
        return dq, dk, dv

    @staticmethod
    @second_order_only
    def backward(ctx, ga, gb, gc):
        q, k, v, do = ctx.saved_tensors
        kernels = _kernels()
        ga, gb, gc = (None if g is None else kernels.token_major(g.to(q.dtype)) for g in (ga, gb, gc))
        gq, gk, gv, gdo = kernels.double_backward(ga, gb, gc, q, k, v, do, ctx.stats, ctx.dl, ctx.bias, ctx.keep,
                                                  ctx.span, ctx.scale, ctx.inv_keep)
        return gq, gk, gv, None, gdo, None, None, None, None, None, None


def reference(q, k, v, bias=None, keep=None, scale=None, inv_keep=1.0):
    """The plain composition: ``softmax(scale·q kᵀ + bias) ∘ keep · inv_keep @ v`` (a row whose every score is
    -inf: probabilities 0, as SDPA's), twice differentiable by autograd."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.to(s.dtype)
    empty = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.where(empty, 0.0, torch.softmax(torch.where(empty, 0.0, s), -1))
    if keep is not None:
        p = p * keep.to(p.dtype) * inv_keep
    return p @ v


def _checked(q, k, v, mask, dropout_p):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: expected a [B, H, T, D] tensor, got {getattr(t, 'shape', type(t))}")
    B, H, TQ, D = q.shape
    if k.shape[:2] != (B, H) or k.shape[3] != D or v.shape != k.shape:
        raise ValueError(f"expected q [B, H, TQ, D] and k, v [B, H, TK, D], got q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise ValueError(f"q, k, v: expected one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1), got {dropout_p}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.requires_grad:
            raise ValueError("mask: expected a bool or float tensor without a gradient")
        try:
            torch.broadcast_shapes(mask.shape, (B, H, TQ, k.shape[2]))
        except RuntimeError:
            raise ValueError(f"mask: expected a shape broadcastable to [B, H, TQ, TK] = {[B, H, TQ, k.shape[2]]}, "
                             f"got {tuple(mask.shape)}") from None


def _bias(mask, q, shape):
    """The mask as an additive score bias of `shape` (broadcast strides), at the accumulation precision."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        mask = torch.zeros(mask.shape, device=q.device, dtype=acc).masked_fill_(~mask, float("-inf"))
    return mask.to(q.device).expand(shape)


def attention(q, k, v, mask=None, dropout_p: float = 0.0, scale=None, keep=None):
    """Scaled dot-product attention, twice differentiable (module docstring). `keep`: the dropout's keep mask
    (``[B, H, TQ, TK]``, nonzero = kept) instead of a draw; `scale` None: ``D ** -0.5``."""
    _checked(q, k, v, mask, dropout_p)
    B, H, TQ, D = q.shape
    shape = (B, H, TQ, k.shape[2])
    scale = D ** -0.5 if scale is None else float(scale)
    inv_keep = 1.0 / (1.0 - float(dropout_p))
    if keep is None and dropout_p > 0.0:
        keep = torch.empty(shape, device=q.device, dtype=torch.uint8).bernoulli_(1.0 - float(dropout_p))
    elif keep is not None:
        if tuple(keep.shape) != shape:
            raise ValueError(f"keep: expected shape {list(shape)}, got {tuple(keep.shape)}")
        keep = keep.to(device=q.device, dtype=torch.uint8).contiguous()
    if not available(q.device) or q.numel() == 0 or k.shape[2] == 0:
        out = reference(q, k, v, _bias(mask, q, shape), keep, scale, inv_keep)
        return out.transpose(1, 2).contiguous().transpose(1, 2)
    bias = _bias(mask, q, shape)
    kernels = _kernels()
    span = kernels.key_span(bias)
    q, k, v = (kernels.token_major(t) for t in (q, k, v))
    return _Attention.apply(q, k, v, bias, keep, span, scale, inv_keep)


def hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """`attention` as a Hugging Face attention implementation: ``(out [B, T, H, D], None)``. Key and value heads
    shared by several query heads are repeated; a causal module without a mask gets the causal mask."""
    if kwargs.get("output_attentions"):
        raise ValueError(f"attention implementation {NAME!r} does not return attention probabilities")
    if key.shape[1] != query.shape[1]:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    TQ, TK = query.shape[2], key.shape[2]
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", False) if causal is None else causal
    if attention_mask is None and causal and TQ > 1:
        attention_mask = torch.ones(TQ, TK, device=query.device, dtype=torch.bool).tril(TK - TQ)
    elif attention_mask is not None and attention_mask.shape[-1] != TK:
        attention_mask = attention_mask[..., :TK]
    out = attention(query, key, value, attention_mask, dropout, scaling)
    return out.transpose(1, 2), None


@functools.cache
def register() -> str:
    """Register `NAME` with Hugging Face's attention and attention-mask interfaces (SDPA's mask: bool, True
    attends); returns NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, hf_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def _configs(model):
    seen = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())


@contextlib.contextmanager
def installed(model):
    """Run `model`'s Hugging Face attention modules on `NAME` for the block (its configs' ``_attn_implementation``
    set, and restored after)."""
    register()
    configs = _configs(model)
    saved = [(c, c._attn_implementation) for c in configs]
    try:
        for c in configs:
            c._attn_implementation = NAME
        yield model
    finally:
        for c, value in saved:
            c._attn_implementation = value
