"""The last encoder layer computed for the first token only: for heads that read row 0 of the last hidden state
(BERT's pooler, DistilBERT's pre-classifier, the RoBERTa / ELECTRA / XLM-R heads), the other rows are dead work.

``forward(layer, args, kwargs)`` returns the layer's output with row 0 computed (keys and values of every token,
the rest for row 0: about 1/6 of the layer's matmuls) and rows 1.. the layer's input rows, or None where it does
not apply. The layer's own submodules compute the projections and blocks, so forward hooks on them run, on the
rows computed. Supported: the families of `layout.LAYOUTS` (`layout.pieces`), post-LN, SDPA or eager attention,
absolute positions. `models.first_token_ok` checks once per model that the head reads only row 0 and that this
layer gives the full layer's row 0.

Input-only passes (``input_only=True``: CAT's counterfactual passes, where no parameter gradient is taken) of a Bert
layout whose key and value projections are plain modules can compute keys and values in one matmul on the step's
shared 16-bit weight copies (`casts.weights`), reading the previous fast layer's 16-bit copy of the input
(`layout.copy16`), with the input's gradient in one product accumulated at the input's precision and row 0's added
in place (no per-projection casts, no zero-filled gradient of the first row). The same values and dropout draws (the
attention is the same `attention.first_row` call, given the keys and values as one tensor: their gradient is
written as one); the input gradient is summed in fp32 under autocast (the modules round each projection's to 16
bits first). `INPUT_ONLY_KEY_VALUE` (True by default) turns it off when False (its timing: benchmarks/RESULTS.md).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from . import attention, casts, interventions, layout

__all__ = ["supported", "forward", "INPUT_ONLY_KEY_VALUE"]

_ATTENTION = ("sdpa", "eager")

# Whether input-only passes compute keys and values in one matmul (module docstring).
INPUT_ONLY_KEY_VALUE = True


class _KeyValueFirst(torch.autograd.Function):
    """``x -> (x W_kvᵀ + b_kv, x[:, :1])`` with the product in `dtype` from x's 16-bit copy (`layout.copy16`); no
    parameter gradients. Backward: ``g_x = g_kv W_kv`` accumulated at x's precision (fp32 by the matmul on CUDA),
    with row 0's gradient added in place."""

    @staticmethod
    def forward(ctx, x, dtype, w_kv, b_kv):
        B, T, D = x.shape
        x16 = layout.copy16(x, dtype).reshape(B * T, D)
        kv = torch.addmm(b_kv, x16, w_kv.t()).view(B, T, w_kv.shape[0])
        ctx.save_for_backward(w_kv)
        ctx.x_dtype, ctx.x_shape = x.dtype, x.shape
        return kv, x[:, :1].clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_kv, grad_first):  # both materialized (zeros where unused)
        (w_kv,) = ctx.saved_tensors
        acc = torch.promote_types(ctx.x_dtype, torch.float32)
        grad_x = layout.mm_at(grad_kv.reshape(-1, grad_kv.shape[-1]), w_kv, acc).view(ctx.x_shape)
        grad_x[:, :1] += grad_first.to(acc)
        return grad_x.to(ctx.x_dtype), None, None, None


def _key_value_weights(layer, parts, x):
    """``(dtype, W_kv, b_kv)`` for the one-matmul keys and values of an input-only pass, or None where the layer or
    the call does not allow it (a family whose weights are not read directly, `Layout.fused`: only the Bert
    layout's are; hooked or non-plain key/value modules, LoRA projections `layout.lora_refusal` refuses, missing
    biases, parameters of another dtype or device, an autocast setting other than an fp32 layer under 16-bit
    autocast)."""
    if (not INPUT_ONLY_KEY_VALUE or not parts.spec.fused or type(parts.key) is not nn.Linear
            or type(parts.value) is not nn.Linear or any(layout.lora_refusal(m) for m in layer.modules())):
        return None
    params = layout.bert_projections(layer)
    if (any(p is None for p in params) or not layout.plain(parts.key, parts.value)
            or any(p.device != x.device or p.dtype != params[0].dtype for p in params)):
        return None
    dtype = layout.compute_dtype(x, params[0].dtype)
    if dtype is None:
        return None
    w16 = casts.weights(layer, params, dtype)
    n_q = parts.query.out_features
    return dtype, w16.qkv[n_q:], w16.qkv_bias[n_q:]


def _layout_ok(parts):
    a = parts.attention
    config = getattr(a, "config", None)
    return (getattr(config, "_attn_implementation", None) in _ATTENTION
            and getattr(config, "position_embedding_type", "absolute") == "absolute"
            and not getattr(a, "is_causal", False)
            and isinstance(getattr(a, "dropout", None), nn.Dropout) and hasattr(a, "scaling"))


def supported(layer: nn.Module) -> bool:
    """Whether `layer` has a layout this module knows (see the module docstring)."""
    parts = layout.pieces(layer)
    return parts is not None and _layout_ok(parts)


def forward(layer: nn.Module, args, kwargs, fill: float | None = None, row_only: bool = False,
            input_only: bool = False):
    """Row 0 of `layer(*args, **kwargs)`, as a [B, T, D] tensor whose rows 1.. are the layer's input rows
    (detached; nothing reads them) or, with `fill`, that constant; with `row_only`, as a [B, 1, D] tensor (for
    passes whose only reader is a head that reads row 0: no copy of the other rows, and the head's gradient is
    one row, not a zero-filled sequence). `input_only`: no parameter gradient will be taken through this call (the
    module docstring's one-matmul keys and values, where on). None when the layer or this call cannot be handled
    (then run the layer itself)."""
    parts = layout.pieces(layer)
    if parts is None or not _layout_ok(parts):
        return None
    found = layout.call_arguments(args, kwargs)
    if found is None:
        return None
    x, mask = found
    heads = parts.heads
    fast = _key_value_weights(layer, parts, x) if input_only else None
    if fast is not None:
        dtype, w_kv, b_kv = fast
        with torch.autocast(x.device.type, enabled=False):
            keys_values, first = _KeyValueFirst.apply(x, dtype, w_kv, b_kv)  # keys then values, one tensor
        edits = interventions.active(layer)  # on the key / value modules: applied here, as their hooks would
        if edits and ("key" in edits or "value" in edits):
            k, v = keys_values.split((parts.key.out_features, parts.value.out_features), -1)
            keys_values = interventions.apply(edits, "key", k), interventions.apply(edits, "value", v)
    else:
        first = x[:, :1]
        keys_values = parts.key(x), parts.value(x)
    q = parts.query(first)
    if mask is not None and mask.shape[-2] != 1:
        mask = mask[:, :, :1]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    a = parts.attention
    context = attention.first_row(q, keys_values, mask, heads, a.dropout.p if a.training else 0.0, a.scaling)
    row = parts.finish(context, first)
    if row_only:
        return row
    rest = x[:, 1:].detach() if fill is None else torch.full_like(x[:, 1:], fill)
    return torch.cat([row, rest.to(row.dtype)], dim=1)
