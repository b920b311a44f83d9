"""LayerNorm and GELU whose backward is differentiable by fused kernels, and ``installed(model)``, which runs a
model's LayerNorms, GELUs and attention on them for a double backward through every layer (exact gradient
supervision at the token states): eager autograd runs LayerNorm's and GELU's as a few dozen kernels per layer.

``layer_norm(x, normalized_shape, weight, bias, eps)`` and ``gelu(x)`` compute what ``F.layer_norm`` and
``F.gelu`` (erf form) compute, with the same kernels forward and backward (``native_layer_norm`` and its
backward, ``gelu`` and ``gelu_backward``); the backward of their backward is the fused kernels of
`cat_fast.kernels.triton.double_backward` on CUDA with Triton (and on the CPU under the Triton interpreter), their
PyTorch composition elsewhere. A third derivative raises.

``with installed(model):`` runs the model's affine ``nn.LayerNorm`` modules, its erf-form GELU activations
(``nn.GELU`` and Hugging Face's ``GELUActivation``) and its attention (`layers.double_attention`) on them for the
block, and restores them after; other modules keep their own forward. Exact `GradientSupervision` at the token
states does so on CUDA (`objectives.gs`).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from ..ops.fused import fused_kernels, gelu_double_backward, layer_norm_double_backward
from . import double_attention
from .double_attention import second_order_only
from .layout import will_run

__all__ = ["layer_norm", "gelu", "installed", "available"]


def _kernels():
    return fused_kernels("double_backward")


def available(device) -> bool:
    """Whether the fused layers, attention included, run their kernels for tensors on `device` (CUDA with Triton,
    or the Triton interpreter)."""
    return double_attention.available(device) and _kernels() is not None


class _LayerNorm(torch.autograd.Function):
    """``(x, weight, bias, normalized_shape, eps) -> y``; its backward is `_LayerNormGrad`."""

    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps):
        y, mean, rstd = torch.ops.aten.native_layer_norm(x, shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.shape = shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        mask = [_needed(ctx, 0), _needed(ctx, 1), bias is not None and _needed(ctx, 2)]
        dx, dw, db = _LayerNormGrad.apply(x, weight, bias, dy, mean, rstd, ctx.shape, mask)
        return dx, dw, db, None, None


def _needed(ctx, index):
    """Whether the running backward uses the gradient of input `index` of the node `ctx`: not where
    ``torch.autograd.grad(..., inputs)`` asks for other inputs only (exact GS's first backward asks for the token
    states', not the weights'), which PyTorch's own nodes skip too."""
    if not ctx.needs_input_grad[index]:
        return False
    node = ctx.next_functions[index][0]
    return node is not None and will_run(node)


class _LayerNormGrad(torch.autograd.Function):
    """``(x, weight, bias, dy, mean, rstd, normalized_shape, output_mask) -> (dx, dw, db)``: LayerNorm's backward,
    dx, dw or db None where `output_mask` leaves it out (mean and rstd are x's statistics: the double backward
    differentiates them through x)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dy, mean, rstd, shape, mask):
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy, x, shape, mean, rstd, weight, bias, mask)
        ctx.save_for_backward(x, weight, dy, mean, rstd)
        return dx, dw, db

    @staticmethod
    @second_order_only
    def backward(ctx, a, c, e):
        x, weight, dy, mean, rstd = ctx.saved_tensors
        kernels = _kernels() if available(x.device) else None
        run = kernels.layer_norm if kernels is not None else layer_norm_double_backward
        a, c, e = (torch.zeros_like(t) if g is None else g for g, t in ((a, x), (c, weight), (e, weight)))
        g_x, g_w, g_dy = run(x, weight, dy, a, c, e, mean, rstd)
        return g_x, g_w.to(weight.dtype).view(weight.shape), None, g_dy, None, None, None, None


class _Gelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.gelu(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return _GeluGrad.apply(x, dy)


class _GeluGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dy):
        ctx.save_for_backward(x, dy)
        return torch.ops.aten.gelu_backward(dy, x)

    @staticmethod
    @second_order_only
    def backward(ctx, a):
        x, dy = ctx.saved_tensors
        kernels = _kernels() if available(x.device) else None
        return (kernels.gelu if kernels is not None else gelu_double_backward)(x, dy, a)


def _checked_shape(x, normalized_shape, weight):
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if weight is None or tuple(weight.shape) != shape or tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(f"layer_norm: expected x [..., {', '.join(map(str, shape))}] and a weight of that shape, "
                         f"got x {tuple(x.shape)} and weight "
                         f"{None if weight is None else tuple(weight.shape)}")
    return list(shape)


@functools.cache
def _autocast_dtype(device_type, dtypes, autocast_dtype):
    """The dtype autocast runs ``F.layer_norm`` in for inputs of `dtypes` (its policy, read off an empty call)."""
    x, w = (torch.empty(0, 1, device=device_type, dtype=dtypes[0]), torch.empty(1, device=device_type, dtype=dtypes[1]))
    with torch.autocast(device_type, dtype=autocast_dtype):
        return F.layer_norm(x, (1,), w).dtype


def layer_norm(x, normalized_shape, weight, bias=None, eps: float = 1e-5):
    """``F.layer_norm(x, normalized_shape, weight, bias, eps)`` with a fused double backward; `weight` is
    required. Under autocast, in the dtype autocast runs ``F.layer_norm`` in (float32 on CUDA)."""
    shape = _checked_shape(x, normalized_shape, weight)
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        dtype = _autocast_dtype(kind, (x.dtype, weight.dtype), torch.get_autocast_dtype(kind))
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    with torch.autocast(kind, enabled=False):
        return _LayerNorm.apply(x, weight, bias, shape, float(eps))


def gelu(x):
    """``F.gelu(x)`` (erf form) with a fused double backward."""
    return _Gelu.apply(x)


def _layer_norm_forward(module):
    return lambda x: layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)


def _targets(model):
    """(module, forward) for every module of `model` that `installed` replaces."""
    try:
        from transformers.activations import GELUActivation
    except ImportError:  # pragma: no cover - transformers is a dependency
        GELUActivation = ()
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm) and module.weight is not None:
            yield module, _layer_norm_forward(module)
        elif isinstance(module, torch.nn.GELU) and module.approximate == "none":
            yield module, gelu
        elif isinstance(module, GELUActivation) and getattr(module, "act", None) is F.gelu:
            yield module, gelu


@contextlib.contextmanager
def installed(model):
    """Run `model`'s LayerNorms, erf-form GELUs and Hugging Face attention on the twice-differentiable fused
    layers for the block (each module's ``forward`` shadowed by an instance attribute, removed after)."""
    replaced = []
    try:
        for module, forward in _targets(model):
            if "forward" in module.__dict__:  # already replaced (nested blocks): keep the outer one
                continue
            module.forward = forward
            replaced.append(module)
        with double_attention.installed(model):
            yield model
    finally:
        for module in replaced:
            del module.forward
