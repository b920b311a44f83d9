"""A Bert-layout encoder layer for training passes: forward and whole backward (input and parameter gradients) as
one autograd node, with less host work than the model's dozen modules (`models.capture(..., training_layers=True)`,
`models.first_token_forward(..., training_layers=True)`).

``forward(layer, args, kwargs)`` returns the layer's output, or None where it does not apply (then the layer runs
itself). Same arithmetic, order and dropout draws as the layer (equal to 1e-12 in float64, to 16-bit rounding under
autocast; the fused path's hidden dropouts below draw their own); the query, key and value projections are one
matmul, the input is cast once, gradients are accumulated in fp32 by the matmuls, and an input-only backward skips
the weight-gradient matmuls. On CUDA under autocast (an fp32 layer, 16-bit matmuls) the elementwise work around the
matmuls is fused in Triton kernels: residual add + LayerNorm + the cast of its output
(`kernels.triton.residual_layer_norm`), and in the backward LayerNorm backward + dropout backward + the cast, with
the LayerNorm weight and bias gradients and the bias gradient of the projection before the dropout summed in the
same pass, and GELU backward + the intermediate bias gradient (`kernels.triton.gelu_bias_backward`), and with
variable-length attention the join of its dq, dk and dv + the query, key and value bias gradient
(`kernels.triton.column_sums.concat`). The fused path draws the hidden dropouts in its residual LayerNorm kernel
(`OWN_DROPOUT`: cat_fast's own draws, one key per layer from the device's generator; the attention dropout is
SDPA's, or the variable-length attention's own on packed rows); elsewhere, and with ``OWN_DROPOUT = False``, the
dropout draws are `torch.native_dropout`'s, so they are the layer's. The fused path runs from `FUSED_MIN_ROWS` rows
(batch × length) up, where it was measured faster; `FUSED = False` turns it off, for comparisons. Supported: the
layers `resumed.supported` accepts, parameters in one dtype on the input's device, an fp32 layer under autocast or
none; a layer with cat_fast interventions runs a composed version differentiated by autograd. No double backward
(``once_differentiable``).

The packed path (`PACKED`: True wherever it applies, outside the step of an objective that does not declare
`packs_rows`, which runs padded (`packing.padded`); "auto", the default, in the graphs of a captured step on CUDA of
an objective that declares `packs_rows`, from `PACKED_MIN_ROWS` rows; False never) runs the row-wise work on the real
(non-padding) rows only (`layers.packing`): the projections, dropouts, residual adds, LayerNorms and the feed-forward
block on the N real rows of the B·T; the attention by variable-length attention over the packed rows (CUDA,
16-bit), else in the padded layout with zero projections on the padding rows (masked keys; padding queries whose
context nobody reads). It applies to a key-padding mask from which the real tokens can be read, whose first
position is real in every sequence (the row a first-token head reads), with at least `PACKED_MIN_PADDING` of the
rows padding; eagerly (a host synchronisation) or, in a captured step (`CapturedStep`), with a static row count per
graph, the step's real rows rounded up to a 32nd of its rows (`packing.static_rows`, `packing.bucket`; the extra rows
are padding rows, which attend among themselves). Within a forward that allows it (`packing.carrying`:
`models.first_token_forward`, `models.capture` and `models.resume`) a layer hands its packed rows to the next
(`packing.carry`), so the rows are packed once and unpacked once, by the last layer (a first-token last layer reads
them packed: `layers.first_token`). Within `packing.lent` (CAT's padding rows lent to CMIX, which take no
gradient) each packed layer up to the narrowing also carries those rows forward without autograd: their query
attends to their sequence's keys, the rest of the layer row by row (on CUDA on a stream of their own, beside the
layer's work on the real rows: `packing.LENT_LANE`). The unpacked output's padding rows are then
the first packed layer's input rows there (finite values for a consumer that reads them; the padded path computes
attention outputs there, which a key-padding mask keeps from every real row), and the input gradient there is the
output gradient there (the derivative of that copy: zero in a model, where nothing the loss reads depends on
padding rows). Real rows and every gradient equal the padded path's without dropout; under dropout the hidden
dropouts draw their masks over the N rows, so the draws differ from the padded path's (the same distribution, not
the same numbers).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..ops.fused import fused_kernels
from . import casts, interventions, layout, packing, resumed
from .layout import attach_copy16, bert_parts, copy16, dropout, dropout_p, fp32_mm_supported, plain, sdpa_mask

__all__ = ["supported", "parameters", "forward", "packed_mode", "fusion", "gelu_approximate", "wanted",
           "norm_backward", "qkv_grads", "weight_grad", "mm_into", "own_dropout", "FUSED", "FUSED_MIN_ROWS",
           "OWN_DROPOUT", "PACKED", "PACKED_MIN_PADDING", "PACKED_MIN_ROWS"]

# Whether the fused Triton kernels run where they apply (module docstring); False runs the same arithmetic in
# PyTorch ops (16-bit roundings may differ), as the benchmarks compare.
FUSED = True
# The fewest rows (batch × length) the fused path runs for: 1,024, the smallest size the step suite times (8x128),
# where the fused layer is faster than the unfused one (benchmarks/RESULTS.md); fewer rows keep the
# unfused path (not measured).
FUSED_MIN_ROWS = 1024
# Whether the fused path draws the hidden dropouts (after the attention output and the feed-forward output
# projections) inside its residual LayerNorm kernel (`kernels.triton.residual_layer_norm.forward_with_dropout`:
# cat_fast's own draws, from one key per layer drawn from the device's generator, so a CUDA graph and a generator set
# back to a state redraw them), saving the dropout kernel's pass over the projection; `layers.resumed`'s fused path
# draws the same way wherever this one would, so a resumed pass redraws the clean forward's masks. False keeps
# `torch.native_dropout`'s draws, the model's own modules' (the same distribution, not the same numbers).
OWN_DROPOUT = True
# Whether the row-wise work runs on the real rows only (module docstring): True wherever it applies (an eager pass
# reads the real rows on the host) but in the steps of objectives without `packs_rows`, False never, "auto" (the
# default) in the graphs of a captured step (`cat_fast.step.CapturedStep`) on CUDA of an objective that declares
# `packs_rows`, from `PACKED_MIN_ROWS` rows, where it was measured faster (benchmarks/RESULTS.md).
PACKED: "bool | str" = "auto"
# The fewest rows (batch × length) "auto" packs: 4,096 (32x128). At 8x128 the packed step was measured slower
# (its fixed work: the row sort, offsets, gathers and scatters, against 1,024 rows).
PACKED_MIN_ROWS = 4096
# The least fraction of padding rows the packed path runs for: 1/8. Packing adds row gathers and scatters (the
# input, the projections, the context, the output) and a host synchronisation per mask, which less padding would
# not pay for.
PACKED_MIN_PADDING = 0.125


def _weighted(layer):
    """The modules whose weight and bias the layer's computation reads, in `_parameters` order."""
    sa, so, inter, out = bert_parts(layer)
    return (sa.query, sa.key, sa.value, so.dense, so.LayerNorm, inter.dense, out.dense, out.LayerNorm)


def _parameters(weighted):
    """(query W, b, key W, b, value W, b, attention output W, b, its LayerNorm γ, β, intermediate W, b, output W, b,
    its LayerNorm γ, β), each module's as `layout.projection` gives it (a LoRA projection's effective weight)."""
    return tuple(p for m in weighted for p in layout.projection(m))


def gelu_approximate(inter):
    """``approximate`` of the layer's activation when it is ``F.gelu`` (Hugging Face's GELUActivation or the
    function itself), else None (the activation is then differentiated by autograd on its own graph)."""
    act = inter.intermediate_act_fn
    if act is F.gelu:
        return "none"
    if (type(act).__name__ == "GELUActivation" and getattr(act, "act", None) is F.gelu
            and plain(act)):
        return "none"
    return None


# Layers that passed the full check -> (their submodules and the modules' types then, `_weighted(layer)`).
_CHECKED: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _checked(layer: nn.Module):
    """`_weighted(layer)` when the layer can run here (module docstring), else None.

    The full check (`resumed.supported`: layout, module types, hooks; 0.1 ms of host time) runs once per
    layer and again whenever a submodule or its type has changed since (an adapter swapped in, a parametrization
    registered). Other calls check what changes without that (the attention implementation, hooks, an instance-level
    forward) by dictionary lookups."""
    modules = tuple((m, type(m)) for m in layer.modules() if m is not layer)
    entry = _CHECKED.get(layer)
    if entry is None or entry[0] != modules:
        if not resumed.supported(layer):
            return None  # not remembered: hooks and the attention implementation change between calls
        weighted = _weighted(layer)
        if any(p is None for p in _parameters(weighted)):
            return None
        entry = _CHECKED[layer] = (modules, weighted, tuple(m for m, _ in modules if layout.lora(m)))
    if any(layout.lora_refusal(m) for m in entry[2]):  # LoRA dropout in training mode, adapters switched...
        return None
    mm = nn.modules.module
    if mm._global_forward_hooks or mm._global_forward_pre_hooks or any(
            m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m, _ in modules):
        ok = resumed.supported(layer)  # Hugging Face's output recorders are hooks that record nothing
    else:
        ok = getattr(layer.attention.self.config, "_attn_implementation", None) == "sdpa"
    return entry[1] if ok else None


def supported(layer: nn.Module) -> bool:
    """Whether `layer` can run here (module docstring); the call itself is checked by `forward`."""
    return _checked(layer) is not None


def parameters(layer: nn.Module) -> tuple | None:
    """The sixteen parameters the layer's computation reads (query W, b, key W, b, value W, b, attention output W,
    b, its LayerNorm γ, β, intermediate W, b, output W, b, its LayerNorm γ, β) when it can run here, else None."""
    weighted = _checked(layer)
    return None if weighted is None else _parameters(weighted)


def packed_mode() -> "bool | str":
    """`PACKED` checked: True, False or "auto" (module docstring); any other value raises naming it."""
    if PACKED is True or PACKED is False or PACKED == "auto":
        return PACKED
    raise ValueError(f"cat_fast.layers.training.PACKED: expected True, False or 'auto', got {PACKED!r}")


def fusion(hidden, dtype, layer_norm_dtype):
    """``(residual_layer_norm, gelu_bias_backward, column_sums)`` kernel modules when the fused path applies (CUDA,
    an fp32 layer under autocast, Triton importable, `FUSED`, `FUSED_MIN_ROWS` rows or more), else None."""
    if not (FUSED and hidden.shape[:-1].numel() >= FUSED_MIN_ROWS and hidden.is_cuda and hidden.dtype == torch.float32
            and layer_norm_dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16)):
        return None
    kernels = fused_kernels("residual_layer_norm"), fused_kernels("gelu_bias_backward"), fused_kernels("column_sums")
    return kernels if None not in kernels else None


def own_dropout(hidden, dtype, layer_norm_dtype, p1, p2) -> bool:
    """Whether a layer of input `hidden` (its rows as the layer runs them) draws its hidden dropouts (probabilities
    `p1`, `p2`) in the residual LayerNorm kernel (`OWN_DROPOUT`): where the fused path applies and one of them is
    positive."""
    return bool(OWN_DROPOUT and (p1 or p2) and fusion(hidden, dtype, layer_norm_dtype) is not None)


def forward(layer: nn.Module, args, kwargs, packed_only: bool = False) -> torch.Tensor | None:
    """The output tensor of `layer(*args, **kwargs)`, differentiable w.r.t. the input and the layer's parameters,
    or None when the layer or this call is not handled here (then run the layer itself). `packed_only`: only where
    the rows are packed (None elsewhere), with or without autograd: a pass that must draw its dropout over the rows
    its clean forward packed (`models.resume(..., input_grad_only=True)`)."""
    grad = torch.is_grad_enabled()
    weighted = _checked(layer) if grad or packed_only else None
    if weighted is None:
        return None
    hidden_in = args[0] if args else kwargs.get("hidden_states")
    carried = packing.carried(hidden_in)  # the previous layer's packed rows (`packing.carry`)
    found = layout.call_arguments(args, kwargs, None if carried is None else carried[0].T)
    if found is None:
        return None
    hidden, mask = found
    params = _parameters(weighted)
    first = params[0]
    if (not hidden.is_floating_point() or hidden.device != first.device
            or any(p.dtype != first.dtype or p.device != first.device for p in params)):
        return None
    dtype = layout.compute_dtype(hidden, first.dtype)
    if dtype is None or (grad and not (hidden.requires_grad or any(p.requires_grad for p in params))):
        return None
    edits = interventions.active(layer)
    lent = packing.lent_state()
    if edits:
        if packed_only:  # `layers.resumed` composes the edits, in the padded layout as here
            return None
        if carried is not None:
            hidden = packing.unpack(hidden, *carried)
        if lent is not None and lent.active():
            lent.broken = True
        return _composed(layer, hidden, mask, dtype, edits)
    packed = carried[0] if carried is not None else _packed_plan(hidden, mask)
    if packed_only and packed is None:
        return None
    if carried is not None:
        full, rows, link = carried[1], hidden, carried[2]
    else:
        if packed is None:
            if lent is not None and lent.active():
                lent.broken = True
            return _TrainingLayer.apply(hidden, mask, None, layer, dtype, *params)
        full, rows = hidden, packing.pack(hidden, packed)
        link = packing.link(rows)
        if lent is not None and lent.x is None and not lent.done:  # the lent rows start from the first packed input
            lent.x = full.detach().reshape(-1, full.shape[-1]).index_select(0, lent.idx)
    y = _TrainingLayer.apply(rows, mask, packed, layer, dtype, *params)
    if packing.may_carry(layer):
        return packing.carry(y, packed, full, link)
    return packing.unpack(y, packed, full, link)


def _packed_plan(hidden, mask):
    """The packed layout the packed path runs on (`packing.plan`), or None: the padded path. While a CUDA graph is
    captured only with a static row count (`packing.static_rows`, which `CapturedStep` sets)."""
    mode = packed_mode()
    if not mode or mask is None or packing.refused():
        return None
    if packing.static_count() is None and (mode == "auto" or (hidden.is_cuda
                                                                 and torch.cuda.is_current_stream_capturing())):
        return None
    B, T, _ = hidden.shape
    return packing.plan(mask, B, T, PACKED_MIN_PADDING)


def _composed(layer, hidden, mask, dtype, edits):
    """The layer in PyTorch ops differentiated by autograd (input and parameters), with the interventions `edits`
    applied where the model's own modules would apply them; the same dropout draws."""
    sa, so, inter, out = bert_parts(layer)
    B, T, _ = hidden.shape
    heads, width = sa.num_attention_heads, sa.attention_head_size

    def linear(x, module):
        weight, bias = layout.projection(module)
        return F.linear(x, weight.to(dtype), bias.to(dtype))

    with torch.autocast(hidden.device.type, enabled=False):
        x = hidden.to(dtype)
        q, k, v = (interventions.apply(edits, name, linear(x, m)).view(B, T, heads, width).transpose(1, 2)
                   for name, m in (("query", sa.query), ("key", sa.key), ("value", sa.value)))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask(mask, dtype),
                                                 dropout_p=sa.dropout.p if sa.training else 0.0, scale=sa.scaling)
        attended = so.dropout(linear(context.transpose(1, 2).reshape(B, T, heads * width), so.dense))
        h1 = interventions.apply(edits, "attention_output", so.LayerNorm(attended + hidden))
        activated = interventions.apply(edits, "intermediate", inter.intermediate_act_fn(linear(h1.to(dtype),
                                                                                                 inter.dense)))
        projected = out.dropout(linear(activated, out.dense))
        return interventions.apply(edits, "output", out.LayerNorm(projected + h1))


def _dropout_backward(grad, keep, p):
    if keep is None:
        return grad
    if keep.dtype == torch.bool:
        return torch.ops.aten.native_dropout_backward(grad, keep, 1.0 / (1.0 - p))
    return grad * keep


def mm_into(acc, a, b):
    """``acc + a @ b`` accumulated at acc's precision (in place into acc, which this module owns)."""
    if (fp32_mm_supported(acc.device) and acc.dtype == torch.float32
            and a.dtype in (torch.bfloat16, torch.float16)):
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return acc.add_((a @ b).to(acc.dtype))


def qkv_grads(need, weights, biases):
    """The six query / key / value gradients in the parameters' order (wq, bq, wk, bk, wv, bv), each None where
    `need` (the first six of the sixteen parameters' flags) does not want it."""
    ordered = (weights[0], biases[0], weights[1], biases[1], weights[2], biases[2])
    return [g if need[i] else None for i, g in enumerate(ordered)]


def weight_grad(grad_rows, input_rows, dtype):
    """``grad_rowsᵀ @ input_rows`` in the parameter dtype, accumulated in fp32 (or wider)."""
    return layout.mm_at(grad_rows.t(), input_rows, dtype)


def _will_run(param) -> bool:
    return layout.will_run(torch.autograd.graph.get_gradient_edge(param).node)


def wanted(needs, params):
    """Which parameter gradients this backward must compute: those that need one, less those the running
    backward will not deliver (``torch.autograd.grad(out, inputs)`` differentiating the input only, as GS's ``g``
    does: the weight-gradient matmuls are then skipped, as the model's own autograd nodes skip them). Asked for one
    parameter, and for each only when that one is not wanted."""
    if not needs[0] or not hasattr(torch._C, "_will_engine_execute_node") or _will_run(params[0]):
        return needs
    return tuple(n and _will_run(p) for n, p in zip(needs, params))


def norm_backward(rln, grad_y, branch, residual, weight, mean, rstd, keep, p, need, raw=False):
    """``(grad_s, grad_branch, grad_weight, grad_bias, grad_branch_bias)`` of ``LayerNorm(dropout(branch) +
    residual)`` by the fused kernel; `need` says which of the branch's bias, the weight and the bias want gradients
    (those not wanted are None; none wanted: the input-only kernel); `raw`: `branch` is before its dropout (the
    kernel drew it, `OWN_DROPOUT`), else after it."""
    scale = 1.0 / (1.0 - p)
    if not any(need):
        return (*rln.backward(grad_y, branch, residual, weight, mean, rstd, keep, scale, raw=raw), None, None, None)
    grad_s, grad_branch, grad_weight, grad_bias, grad_branch_bias = rln.backward_with_params(
        grad_y, branch, residual, weight, mean, rstd, keep, scale, raw=raw)
    return (grad_s, grad_branch, grad_weight if need[1] else None, grad_bias if need[2] else None,
            grad_branch_bias if need[0] else None)


def _lent_forward(lent, layer, packed, mask, qkv, w16, fused, dtype, norms, dims, cu_k=None):
    """`packing.lent`'s rows through `layer`, without autograd: their query projected, attending to their
    sequence's keys (the keys and values `qkv` the layer computed over the packed real rows; by variable-length
    attention, `cu_k` each sequence's key offsets, None: the plan's), then the attention output, dropouts, residual
    adds, LayerNorms and feed-forward block row by row, as this layer's forward computes a row (and the padded path a
    padding row)."""
    g1, be1, g2, be2 = norms
    B, T, heads, width, p_attn, scale, p1, p2, approximate = dims
    sa, so, inter, out = bert_parts(layer)
    D = heads * width  # the attention's width; the LayerNorms normalise the hidden width, x's
    x = lent.x
    hidden = x.shape[-1]
    x16 = lent.x16 if lent.x16 is not None else x.to(dtype)
    q = torch.addmm(w16.qkv_bias[:D], x16, w16.qkv[:D].t())
    if packing.varlen_applies(qkv, width):
        k, v = (qkv[:, i * D:(i + 1) * D].view(-1, heads, width) for i in (1, 2))
        if cu_k is None:
            cu_k = packed.offsets()[0][:B + 1]  # each sequence's real rows
        context = packing.varlen_forward(q.view(-1, heads, width), k, v, lent.cu, cu_k, T, T, p_attn, scale,
                                         covered=False)[0].view(-1, D)
    else:  # the padded layout: the lent queries at their rows, the keys and values of the packed rows
        full_q = q.new_zeros(B * T + 1, D).index_copy_(0, lent.dest, q)[:B * T]
        kv = qkv.new_zeros(B * T, 2 * D).index_copy_(0, packed.idx, qkv[:, D:])
        q4, k4, v4 = (t.reshape(B, T, heads, width).transpose(1, 2) for t in (full_q, kv[:, :D], kv[:, D:]))
        context = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=sdpa_mask(mask, dtype), dropout_p=p_attn,
                                                 scale=scale)
        context = context.transpose(1, 2).reshape(B * T, D).index_select(0, lent.idx)
    a, _ = dropout(torch.addmm(w16.attention_output_bias, context, w16.attention_output.t()), p1)
    if fused:
        h1, h1_16, _, _ = fused[0].forward(a, x, g1, be1, so.LayerNorm.eps, out16_dtype=dtype)
    else:
        h1 = torch.native_layer_norm(a + x, (hidden,), g1, be1, so.LayerNorm.eps)[0]
        h1_16 = h1.to(dtype)
    inner = torch.addmm(w16.intermediate_bias, h1_16, w16.intermediate.t())
    activated = (F.gelu(inner, approximate=approximate) if approximate is not None
                 else inter.intermediate_act_fn(inner))
    o, _ = dropout(torch.addmm(w16.output_bias, activated, w16.output.t()), p2)
    if fused:
        y, y16, _, _ = fused[0].forward(o, h1, g2, be2, out.LayerNorm.eps, out16_dtype=dtype)
    else:
        y, y16 = torch.native_layer_norm(o + h1, (hidden,), g2, be2, out.LayerNorm.eps)[0], None
    lent.x, lent.x16 = y, y16


class _TrainingLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, mask, packed, layer, dtype, *params):
        wq, bq, wk, bk, wv, bv, wo, bo, g1, be1, wi, bi, wo2, bo2, g2, be2 = params
        sa, so, inter, out = bert_parts(layer)
        D = hidden.shape[-1]
        B, T = (hidden.shape[0], hidden.shape[1]) if packed is None else (packed.B, packed.T)
        heads, width = sa.num_attention_heads, sa.attention_head_size
        p_attn = sa.dropout.p if sa.training else 0.0
        p1, p2 = dropout_p(so.dropout), dropout_p(out.dropout)
        approximate = gelu_approximate(inter)
        with torch.autocast(hidden.device.type, enabled=False):
            x = hidden.reshape(-1, D)  # packed: the plan's rows only
            x16 = copy16(hidden, dtype).reshape(-1, D)  # the previous fast layer's 16-bit copy, or a cast
            fused = fusion(x, dtype, g1.dtype)
            w16 = casts.weights(layer, (wq, wk, wv, bq, bk, bv, wo, bo, wi, bi, wo2, bo2), dtype)
            w_qkv = w16.qkv
            qkv = torch.addmm(w16.qkv_bias, x16, w_qkv.t())
            lent = packing.lent_state() if packed is not None else None
            lane = cu_k = None
            if lent is not None and lent.active() and packing.varlen_applies(qkv, width):
                # the lent rows' work is issued after the layer's (the same draws in the same order) and runs from
                # here on, beside the layer's, on a lane of its own (`packing.LENT_LANE`): what it reads of the
                # layer's is made by now (each sequence's keys: the offsets `packing.attend` would make next)
                cu_k = packed.offsets()[0][:B + 1]
                lane = lent.lane((qkv, cu_k, w16))
            qkv_leaf = qkv.detach().requires_grad_(True)
            context, rows = packing.attend(qkv_leaf, (B, T, heads, width), lambda: sdpa_mask(mask, dtype),
                                           p_attn, sa.scaling, packed)
            wo16 = w16.attention_output
            # the hidden dropouts drawn in the LayerNorm kernel (`OWN_DROPOUT`): `a` and `o` stay as projected
            key = fused[0].draw_key(x.device) if fused and own_dropout(x, dtype, g1.dtype, p1, p2) else None
            raw = (key is not None and p1 > 0, key is not None and p2 > 0)
            a = torch.addmm(w16.attention_output_bias, rows, wo16.t())
            if fused:  # s1 = a + x is recomputed by the backward from a and x
                a, keep1, h1, h1_16, mean1, rstd1 = layout.norm_forward(fused[0], a, x, g1, be1, so.LayerNorm.eps,
                                                                        p1, key, 0, dtype)
                first_sum = dict(a=a, x=x)
            else:
                a, keep1 = dropout(a, p1)
                s1 = a + x
                h1, mean1, rstd1 = torch.native_layer_norm(s1, (D,), g1, be1, so.LayerNorm.eps)
                h1_16 = h1.to(dtype)
                first_sum = dict(s1=s1)
            wi16 = w16.intermediate
            inner = torch.addmm(w16.intermediate_bias, h1_16, wi16.t())
            if approximate is not None:
                activated = F.gelu(inner, approximate=approximate)
            else:
                inner = inner.requires_grad_(True)
                with torch.enable_grad():
                    activated = inter.intermediate_act_fn(inner)
            wo2_16 = w16.output
            o = torch.addmm(w16.output_bias, activated.detach(), wo2_16.t())
            if fused:  # the output's 16-bit copy too: the next layer's input cast
                o, keep2, y, y16, mean2, rstd2 = layout.norm_forward(fused[0], o, h1, g2, be2, out.LayerNorm.eps, p2,
                                                                     key, 1, dtype)
                second_sum = dict(o=o, h1=h1)
            else:
                o, keep2 = dropout(o, p2)
                s2 = o + h1
                y, mean2, rstd2 = torch.native_layer_norm(s2, (D,), g2, be2, out.LayerNorm.eps)
                second_sum = dict(s2=s2)
            if lent is not None and lent.active():  # the lent rows through this layer (`packing.lent`)
                with torch.cuda.stream(lane) if lane is not None else contextlib.nullcontext():
                    _lent_forward(lent, layer, packed, mask, qkv, w16, fused, dtype, (g1, be1, g2, be2),
                                  (B, T, heads, width, p_attn, sa.scaling, p1, p2, approximate), cu_k)
        saved = dict(x16=x16, w_qkv=w_qkv, qkv_leaf=qkv_leaf, context=context, rows=rows, wo16=wo16, keep1=keep1,
                     **first_sum, mean1=mean1, rstd1=rstd1, h1_16=h1_16, wi16=wi16, inner=inner,
                     activated=activated, wo2_16=wo2_16, keep2=keep2, **second_sum, mean2=mean2, rstd2=rstd2, g1=g1,
                     be1=be1, g2=g2, be2=be2)
        # saved tensors (not ctx attributes) are freed when the backward has run, as the layer's own are
        ctx.save_for_backward(*saved.values())
        ctx.names = tuple(saved)
        ctx.fused, ctx.packed, ctx.shape, ctx.raw = fused, packed is not None, hidden.shape, raw
        ctx.params = params  # leaves that outlive the step: only to ask whether this backward wants their gradients
        ctx.shapes = (B, T, D, heads, width, p1, p2, approximate, hidden.dtype, g1.dtype,
                      (wq.shape[0], wk.shape[0], wv.shape[0]))
        shape = hidden.shape
        return attach_copy16(y.view(shape), y16.view(shape)) if fused else y.view(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        t = dict(zip(ctx.names, ctx.saved_tensors))
        B, T, D, heads, width, p1, p2, approximate, x_dtype, p_dtype, qkv_sizes = ctx.shapes
        g1, be1, g2, be2 = t["g1"], t["be1"], t["g2"], t["be2"]
        need = wanted(ctx.needs_input_grad[5:], ctx.params)
        dtype = t["x16"].dtype
        fused = ctx.fused
        grad_rows = grad_y.reshape(-1, D)
        with torch.autocast(grad_y.device.type, enabled=False):
            if fused:
                grad_s2, grad_o, grad_g2, grad_be2, grad_bo2 = norm_backward(
                    fused[0], grad_rows, t["o"], t["h1"], g2, t["mean2"], t["rstd2"], t["keep2"], p2,
                    need[13:16], raw=ctx.raw[1])
            else:
                grad_s2, grad_g2, grad_be2 = torch.ops.aten.native_layer_norm_backward(
                    grad_rows.to(t["s2"].dtype), t["s2"], (D,), t["mean2"], t["rstd2"], g2, be2,
                    (True, need[14], need[15]))
                grad_o = _dropout_backward(grad_s2.to(dtype), t["keep2"], p2)
                grad_bo2 = grad_o.sum(0, dtype=p_dtype) if need[13] else None
            grad_wo2 = weight_grad(grad_o, t["activated"].detach(), p_dtype) if need[12] else None
            grad_activated = torch.mm(grad_o, t["wo2_16"])
            grad_bi = None
            if fused and approximate == "none":
                grad_inner, grad_bi = fused[1].backward(grad_activated, t["inner"], want_bias=need[11])
            elif approximate is not None:
                grad_inner = torch.ops.aten.gelu_backward(grad_activated, t["inner"], approximate=approximate)
            else:
                (grad_inner,) = torch.autograd.grad(t["activated"], t["inner"], grad_activated, retain_graph=True)
            grad_wi = weight_grad(grad_inner, t["h1_16"], p_dtype) if need[10] else None
            if grad_bi is None and need[11]:
                grad_bi = grad_inner.sum(0, dtype=p_dtype)
            grad_h1 = mm_into(grad_s2, grad_inner, t["wi16"])  # the residual's gradient + the projection's
            if fused:
                grad_s1, grad_a, grad_g1, grad_be1, grad_bo = norm_backward(
                    fused[0], grad_h1, t["a"], t["x"], g1, t["mean1"], t["rstd1"], t["keep1"], p1, need[7:10],
                    raw=ctx.raw[0])
            else:
                grad_s1, grad_g1, grad_be1 = torch.ops.aten.native_layer_norm_backward(
                    grad_h1, t["s1"], (D,), t["mean1"], t["rstd1"], g1, be1, (True, need[8], need[9]))
                grad_a = _dropout_backward(grad_s1.to(dtype), t["keep1"], p1)
                grad_bo = grad_a.sum(0, dtype=p_dtype) if need[7] else None
            grad_wo = weight_grad(grad_a, t["rows"], p_dtype) if need[6] else None
            want_b_qkv = any(need[1:6:2])
            # fused (fp32 parameters): the bias gradient summed while the attention's dq, dk, dv are joined, where
            # variable-length attention ran, else by Triton's column sums (PyTorch's are latency-bound here)
            grad_qkv, grad_b_qkv = packing.attention_backward(
                t["context"], t["qkv_leaf"], torch.mm(grad_a, t["wo16"]), (B, T, heads, width), ctx.packed,
                column_sums=bool(fused) and want_b_qkv and p_dtype == torch.float32)
            grad_x = mm_into(grad_s1.to(torch.promote_types(x_dtype, grad_s1.dtype)), grad_qkv, t["w_qkv"])
            grad_w_qkv = weight_grad(grad_qkv, t["x16"], p_dtype) if any(need[0:6:2]) else None
            if grad_b_qkv is None and want_b_qkv:
                grad_b_qkv = (fused[2].column_sums(grad_qkv.unsqueeze(0), grad_qkv.shape[1])[0] if fused
                              else grad_qkv.sum(0, dtype=p_dtype))
        wq_wk_wv = grad_w_qkv.split(qkv_sizes) if grad_w_qkv is not None else (None,) * 3
        bq_bk_bv = grad_b_qkv.split(qkv_sizes) if grad_b_qkv is not None else (None,) * 3
        grads_qkv = qkv_grads(need, wq_wk_wv, bq_bk_bv)
        grad_hidden = None
        if ctx.needs_input_grad[0]:
            grad_hidden = grad_x.to(x_dtype).view(ctx.shape)
        return (grad_hidden, None, None, None, None, *grads_qkv, grad_wo, grad_bo, grad_g1, grad_be1, grad_wi, grad_bi,
                grad_wo2, grad_bo2, grad_g2, grad_be2)
