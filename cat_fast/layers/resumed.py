"""A Bert-layout encoder layer differentiated for its input only: CAT's counterfactual passes (`models.resume(...,
input_grad_only=True)`), where no parameter gradient is taken.

``forward(layer, args, kwargs)`` returns the layer's output, or None where it does not apply (then the layer runs
itself). Same arithmetic, order and dropout draws as the layer; each input cast once, the input gradient
accumulated in fp32 by the matmuls; on CUDA under autocast, residual add + LayerNorm fused with the casts and the
dropout mask (`kernels.triton.residual_layer_norm`), the hidden dropouts drawn as `layers.training` draws them for
the same input (in its LayerNorm kernel where `training.own_dropout`), so a resumed pass redraws its clean forward's
masks. Supported: the Bert layout of `first_token` with SDPA
attention, plain torch.nn parts without forward hooks except cat_fast's interventions (applied here, in the
composed path); calls without cross-attention inputs or caches.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..ops.fused import fused_kernels
from . import casts, first_token, interventions, layout
from .layout import attach_copy16, bert_parts, copy16, dropout_p, fp32_mm_supported, plain, sdpa_mask

__all__ = ["supported", "forward"]


def supported(layer: nn.Module) -> bool:
    """Whether `layer` has the Bert layout with SDPA attention (see the module docstring)."""
    parts = bert_parts(layer)
    if parts is None or not first_token.supported(layer):
        return False
    sa, so, inter, out = parts
    inner = [m for m in layer.modules() if m is not layer and m is not getattr(inter, "intermediate_act_fn", None)]
    denses = (getattr(m, "dense", None) for m in (so, inter, out))
    return (getattr(sa.config, "_attn_implementation", None) == "sdpa"
            and plain(*inner)  # the layer's parts are read, not called: no hooks, plain types
            and not any(layout.lora_refusal(m) for m in inner)  # LoRA projections read as one weight each
            and all(isinstance(d, nn.Linear) or layout.lora(d) for d in denses)
            and all(m.bias is not None for m in (sa.query, sa.key, sa.value, so.dense, inter.dense, out.dense))
            and all(isinstance(getattr(m, "LayerNorm", None), nn.LayerNorm) for m in (so, out))
            and all(isinstance(getattr(m, "dropout", None), nn.Dropout) for m in (so, out))
            and callable(getattr(inter, "intermediate_act_fn", None)))


class _Fork(torch.autograd.Function):
    """``x -> (x W_1^T + b_1, ..., x W_k^T + b_k, x)`` with the projections in `dtype`; no parameter gradients.

    Backward: ``g_x = g_residual + Σ g_i W_i`` accumulated in fp32 by the matmuls (CUDA), or summed after each
    product (elsewhere)."""

    @staticmethod
    def forward(ctx, x, dtype, *weights_and_biases):
        rows = x.reshape(-1, x.shape[-1]).to(dtype)
        weights, outs = [], []
        for w, b in zip(weights_and_biases[0::2], weights_and_biases[1::2]):
            w = w.to(dtype)
            weights.append(w)
            outs.append(torch.addmm(b.to(dtype), rows, w.t()).view(*x.shape[:-1], w.shape[0]))
        ctx.save_for_backward(*weights)
        ctx.x_dtype = x.dtype
        return (*outs, x)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        *grad_outs, grad_x = grads
        weights = ctx.saved_tensors
        shape = grad_outs[0].shape[:-1] + (weights[0].shape[1],)
        acc_dtype = torch.promote_types(ctx.x_dtype, torch.float32)
        acc = None if grad_x is None else grad_x.reshape(-1, shape[-1]).to(acc_dtype)
        fused = (fp32_mm_supported(weights[0].device) and acc_dtype == torch.float32
                 and weights[0].dtype in (torch.bfloat16, torch.float16))
        owned = acc is None or acc.data_ptr() != grad_x.data_ptr()
        for g, w in zip(grad_outs, weights):
            if g is None:
                continue
            g = g.reshape(-1, g.shape[-1])
            if fused and acc is None:
                acc = torch.mm(g, w, out_dtype=torch.float32)
            elif fused and owned:
                torch.addmm(acc, g, w, out_dtype=torch.float32, out=acc)
            elif fused:  # the incoming gradient may be shared: the first product goes to a new buffer
                acc = torch.addmm(acc, g, w, out_dtype=torch.float32)
            else:
                part = (g @ w).to(acc_dtype)
                acc = part if acc is None else acc + part
            owned = True
        grad = None if acc is None else acc.view(shape).to(ctx.x_dtype)
        return (grad, None) + (None,) * (2 * len(weights))


def _compute_dtype(x):
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def forward(layer: nn.Module, args, kwargs) -> torch.Tensor | None:
    """The output tensor of `layer(*args, **kwargs)` computed here (no parameter gradients), or None when the layer
    or this call cannot be handled (then run the layer itself)."""
    if not supported(layer):
        return None
    found = layout.call_arguments(args, kwargs)
    if found is None:
        return None
    hidden, mask = found
    dtype = _compute_dtype(hidden)
    edits = interventions.active(layer)
    if edits:
        return _composed(layer, hidden, mask, dtype, edits)
    if _fused_ok(layer, hidden, dtype):
        if torch.is_grad_enabled() and hidden.requires_grad:
            return _FusedLayer.apply(hidden, mask, layer, dtype)
        return _fused_forward(layer, hidden, mask, dtype, None)
    return _composed(layer, hidden, mask, dtype)


def _composed(layer, hidden, mask, dtype, found=None):
    """PyTorch ops with `_Fork` at the two layer inputs (any device; query, key and value in one matmul); the
    interventions `found` applied."""
    sa, so, inter, out = bert_parts(layer)
    B, T, _ = hidden.shape
    heads, width = sa.num_attention_heads, sa.attention_head_size
    w16 = casts.weights(layer, layout.bert_projections(layer), dtype)
    with torch.autocast(hidden.device.type, enabled=False):
        qkv, residual = _Fork.apply(hidden, dtype, w16.qkv, w16.qkv_bias)
        q, k, v = qkv.split((sa.query.out_features, sa.key.out_features, sa.value.out_features), -1)
        if found:
            q, k, v = (interventions.apply(found, name, t) for name, t in zip(("query", "key", "value"), (q, k, v)))
        q, k, v = (t.view(B, T, heads, width).transpose(1, 2) for t in (q, k, v))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask(mask, dtype),
                                                 dropout_p=sa.dropout.p if sa.training else 0.0, scale=sa.scaling)
        context = context.transpose(1, 2).reshape(B, T, heads * width)
        attended = so.dropout(F.linear(context, w16.attention_output, w16.attention_output_bias))
        h1 = interventions.apply(found, "attention_output", so.LayerNorm(attended + residual))
        inner, residual = _Fork.apply(h1, dtype, w16.intermediate, w16.intermediate_bias)
        activated = interventions.apply(found, "intermediate", inter.intermediate_act_fn(inner))
        projected = out.dropout(F.linear(activated, w16.output, w16.output_bias))
        return interventions.apply(found, "output", out.LayerNorm(projected + residual))


# ----------------------------------------------------------------------------- fused CUDA path
def _fused_ok(layer, hidden, dtype) -> bool:
    """CUDA, fp32 layer input, 16-bit compute (autocast), Triton importable, dropout probabilities below 1."""
    if not (hidden.is_cuda and hidden.dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16)):
        return False
    _, so, _, out = bert_parts(layer)
    if dropout_p(so.dropout) is None or dropout_p(out.dropout) is None:
        return False
    return _triton_kernels() is not None


def _triton_kernels():
    return fused_kernels("residual_layer_norm")


def _fused_forward(layer, hidden, mask, dtype, saved):
    """The layer's output; when `saved` is a dict, what `_FusedLayer.backward` needs goes there."""
    rln = _triton_kernels()
    sa, so, inter, out = bert_parts(layer)
    B, T, D = hidden.shape
    heads, width = sa.num_attention_heads, sa.attention_head_size
    p_attn = sa.dropout.p if sa.training else 0.0
    p1, p2 = dropout_p(so.dropout), dropout_p(out.dropout)
    with torch.autocast("cuda", enabled=False):
        x = hidden.contiguous()
        xb = copy16(hidden, dtype).reshape(-1, D)  # the previous fast layer's 16-bit copy, or a cast
        w16 = casts.weights(layer, layout.bert_projections(layer), dtype)
        qkv = torch.addmm(w16.qkv_bias, xb, w16.qkv.t())  # query, key and value in one matmul
        track = saved is not None  # the backward differentiates SDPA and the activation on their own small graphs
        if track:
            qkv = qkv.detach().requires_grad_(True)
        with torch.set_grad_enabled(track):
            q, k, v = (t.view(B, T, heads, width).transpose(1, 2)
                       for t in qkv.split((sa.query.out_features, sa.key.out_features, sa.value.out_features), 1))
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask(mask, dtype), dropout_p=p_attn,
                                                     scale=sa.scaling)
        rows = context.detach().transpose(1, 2).reshape(-1, D)
        ln1, ln2 = so.LayerNorm, out.LayerNorm
        # the hidden dropouts drawn as the training layer draws them for this input (`training.OWN_DROPOUT`), so
        # that a resumed pass redraws the clean forward's masks
        from . import training  # here: `training` imports this module
        key = rln.draw_key(x.device) if training.own_dropout(x, dtype, ln1.weight.dtype, p1, p2) else None
        raw = (key is not None and p1 > 0, key is not None and p2 > 0)
        a, keep1, h1, h1b, mean1, rstd1 = layout.norm_forward(
            rln, torch.addmm(w16.attention_output_bias, rows, w16.attention_output.t()), x, ln1.weight, ln1.bias,
            ln1.eps, p1, key, 0, dtype)
        inner = torch.addmm(w16.intermediate_bias, h1b.view(-1, D), w16.intermediate.t())
        if track:
            inner = inner.detach().requires_grad_(True)
        with torch.set_grad_enabled(track):
            activated = inter.intermediate_act_fn(inner)
        o, keep2, y, y16, mean2, rstd2 = layout.norm_forward(
            rln, torch.addmm(w16.output_bias, activated.detach(), w16.output.t()), h1, ln2.weight, ln2.bias, ln2.eps,
            p2, key, 1, dtype)
    if track:
        saved.update(x=x, qkv=qkv, context=context, a=a, keep1=keep1, scale1=1.0 / (1.0 - p1), h1=h1,
                     mean1=mean1, rstd1=rstd1, inner=inner, activated=activated, o=o, keep2=keep2,
                     scale2=1.0 / (1.0 - p2), mean2=mean2, rstd2=rstd2, w_qkv=w16.qkv, wo=w16.attention_output,
                     wi=w16.intermediate, wo2=w16.output, ln1=ln1.weight, ln2=ln2.weight, raw=raw)
    return attach_copy16(y, y16)  # the next layer's input cast



class _FusedLayer(torch.autograd.Function):
    """The layer's forward (`_fused_forward`) and the gradient with respect to its input only: LayerNorm backward
    with the dropout mask and the cast fused (`triton.residual_layer_norm`), the projections' input gradients
    accumulated in fp32 into the residual gradient by the matmuls, SDPA and the activation differentiated by
    autograd on their own small graphs."""

    @staticmethod
    def forward(ctx, hidden, mask, layer, dtype):
        saved = {}
        y = _fused_forward(layer, hidden, mask, dtype, saved)
        ctx.saved = saved
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        rln = _triton_kernels()
        t = ctx.saved
        ctx.saved = None
        x = t["x"]
        D = x.shape[-1]
        grad_h1, grad_o = rln.backward(grad_y, t["o"], t["h1"], t["ln2"], t["mean2"], t["rstd2"], t["keep2"],
                                       t["scale2"], raw=t["raw"][1])
        grad_activated = torch.mm(grad_o.view(-1, D), t["wo2"])
        (grad_inner,) = torch.autograd.grad(t["activated"], t["inner"], grad_activated)
        rows = grad_h1.view(-1, D)
        torch.addmm(rows, grad_inner, t["wi"], out_dtype=torch.float32, out=rows)
        grad_x, grad_a = rln.backward(grad_h1, t["a"], x, t["ln1"], t["mean1"], t["rstd1"], t["keep1"], t["scale1"],
                                      raw=t["raw"][0])
        B, T, _ = x.shape
        context = t["context"]
        grad_context = torch.mm(grad_a.view(-1, D), t["wo"]).view(B, T, context.shape[1], -1).transpose(1, 2)
        (grad_qkv,) = torch.autograd.grad(context, t["qkv"], grad_context)
        rows = grad_x.view(-1, D)
        torch.addmm(rows, grad_qkv, t["w_qkv"], out_dtype=torch.float32, out=rows)
        return grad_x, None, None, None
