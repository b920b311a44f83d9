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
Where the layer's fused conditions below hold, an input-only pass, and one without gradients (CAT's final
counterfactual pass), runs the training row instead (`INPUT_ONLY_ROW`, True by default): the same node, whose
backward skips the parameter gradients that an input-only ``autograd.grad`` does not deliver (`training.wanted`),
so the remaining projections run on the shared 16-bit copies too and the row's residual adds, LayerNorms and GELU
backward by the fused kernels, in place of the modules' per-pass casts of four weights and their biases.

Passes that take parameter gradients (training) of a layer the training layers run (`layers.training.supported`:
the Bert layout, no hooks, no interventions), an fp32 layer under 16-bit autocast on CUDA, run as one autograd node
(`TRAINING_ROW`): keys and values in one matmul and row 0's query on the step's 16-bit weight copies
(`casts.weights`, cast ahead while the layer before runs), the input cast once (or the previous fast layer's copy),
the attention by the first-row kernel, the row's residual add + dropout + LayerNorm by the fused kernels
(`kernels.triton.residual_layer_norm`), its GELU's backward with the bias gradient (`kernels.triton
.gelu_bias_backward`), the weight gradients accumulated in fp32 by the matmuls and the bias gradients summed in
fp32 (no per-weight casts and casts back, no zero-filled input gradient for row 0). The same values to 16-bit
rounding and the same dropout draws as the modules (the attention's keep mask drawn as `attention.first_row`
draws it, then the two hidden dropouts by `torch.native_dropout` over the row's [B, D] elements).

Packed rows. Where the layer before hands on its packed rows (`layers.packing.carry`: the padding-free layers of a
training forward or a resumed pass), every path above runs on them (`PACKED`): keys and values of the N real rows
only, row 0 of each sequence read where it is packed, the attention over each sequence's keys by the first-row
kernel's packed form (`attention.first_row_packed`; elsewhere the keys put back in the padded layout and SDPA), the
input gradient as packed rows. The same values and dropout draws as on the padded rows (the keep mask is read at the
keys' padded positions). A whole [B, T, D] output gets its rows 1.. by unpacking the input rows (detached).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..ops.fused import fused_kernels
from . import attention, casts, interventions, layout, packing, training
from .layout import bert_parts, copy16, dropout, dropout_p

__all__ = ["supported", "forward", "INPUT_ONLY_KEY_VALUE", "INPUT_ONLY_ROW", "TRAINING_ROW", "PACKED"]

_ATTENTION = ("sdpa", "eager")

# Whether input-only passes compute keys and values in one matmul (module docstring).
INPUT_ONLY_KEY_VALUE = True
# Whether passes that take parameter gradients run as one autograd node where they can (module docstring); False:
# the layer's own modules, for comparisons.
TRAINING_ROW = True
# Whether input-only passes and passes without gradients run that node too where it applies (module docstring);
# False: the keys and values in one matmul and the modules for the rest, for comparisons.
INPUT_ONLY_ROW = True
# Whether a call on packed rows (`layers.packing.carried`) runs on them (module docstring); False: they are unpacked
# first, for comparisons.
PACKED = True


class _KeyValueFirst(torch.autograd.Function):
    """``x -> (x W_kvᵀ + b_kv, x[:, :1])`` with the product in `dtype` from x's 16-bit copy (`layout.copy16`); no
    parameter gradients. Backward: ``g_x = g_kv W_kv`` accumulated at x's precision (fp32 by the matmul on CUDA),
    with row 0's gradient added in place."""

    @staticmethod
    def forward(ctx, x, dtype, w_kv, b_kv, starts=None):
        D = x.shape[-1]
        x16 = layout.copy16(x, dtype).reshape(-1, D)
        kv = torch.addmm(b_kv, x16, w_kv.t())
        ctx.save_for_backward(w_kv, starts)
        ctx.x_dtype, ctx.x_shape = x.dtype, x.shape
        if starts is None:
            B, T, _ = x.shape
            return kv.view(B, T, -1), x[:, :1].clone()
        return kv, x.reshape(-1, D).index_select(0, starts).unsqueeze(1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_kv, grad_first):  # both materialized (zeros where unused)
        w_kv, starts = ctx.saved_tensors
        acc = torch.promote_types(ctx.x_dtype, torch.float32)
        grad_x = layout.mm_at(grad_kv.reshape(-1, grad_kv.shape[-1]), w_kv, acc)
        if starts is None:
            grad_x.view(ctx.x_shape)[:, :1] += grad_first.to(acc)
        else:
            grad_x.index_add_(0, starts, grad_first.reshape(-1, grad_x.shape[-1]).to(acc))
        return grad_x.view(ctx.x_shape).to(ctx.x_dtype), None, None, None, None


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
    hidden_in = args[0] if args else kwargs.get("hidden_states")
    carried = packing.carried(hidden_in)  # the layer before's packed rows (`packing.carry`)
    found = layout.call_arguments(args, kwargs, None if carried is None else carried[0].T)
    if found is None:
        return None
    x, mask = found
    if carried is not None:
        if PACKED and not interventions.active(layer):
            return _packed(layer, parts, x, mask, carried, fill, row_only, input_only)
        x = packing.unpack(x, *carried)
    heads = parts.heads
    row = _training_row(layer, x, mask, input_only=input_only)
    if row is not None:
        return row if row_only else _with_rest(row, x, fill)
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
    mask = _first_row_mask(mask, q.dtype)
    a = parts.attention
    context = attention.first_row(q, keys_values, mask, heads, a.dropout.p if a.training else 0.0, a.scaling)
    row = parts.finish(context, first)
    if row_only:
        return row
    return _with_rest(row, x, fill)


def _packed(layer, parts, x, mask, carried, fill, row_only, input_only):
    """`forward` on the packed rows ``x`` [1, N, D] the layer before handed on (`packing.carried`): keys and values of
    the N rows, row 0 of each sequence read where it is packed, the attention over each sequence's keys
    (`attention.first_row_packed`), and for a whole [B, T, D] output the rows 1.. unpacked from x (detached) or
    `fill`. The same values and dropout draws as the padded call."""
    plan, full, _ = carried
    keys, starts = plan.first_row_keys()
    row = _training_row(layer, x, mask, (plan, keys, starts), input_only)
    if row is None:
        fast = _key_value_weights(layer, parts, x) if input_only else None
        if fast is not None:
            dtype, w_kv, b_kv = fast
            with torch.autocast(x.device.type, enabled=False):
                keys_values, first = _KeyValueFirst.apply(x, dtype, w_kv, b_kv, starts)
        else:
            flat = x.reshape(-1, x.shape[-1])
            first = flat.index_select(0, starts).unsqueeze(1)
            keys_values = torch.cat([parts.key(flat), parts.value(flat)], -1)
        q = parts.query(first)
        a = parts.attention
        context = attention.first_row_packed(q, keys_values.to(q.dtype), keys, plan.real, parts.heads,
                                             a.dropout.p if a.training else 0.0, a.scaling)
        row = parts.finish(context, first)
    if row_only:
        return row
    if fill is not None:
        return torch.cat([row, torch.full_like(full[:, 1:], fill).to(row.dtype)], dim=1)
    return _with_rest(row, packing.unpack(x.detach(), plan, full.detach()), None)


def _first_row_mask(mask, dtype):
    """Row 0's query row of a 4-D attention mask (None stays None), a float mask in the attention's `dtype`."""
    if mask is not None and mask.shape[-2] != 1:
        mask = mask[:, :, :1]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    return mask


def _with_rest(row, x, fill):
    """[B, T, D]: `row` then the input's rows 1.. (detached), or `fill` there."""
    rest = x[:, 1:].detach() if fill is None else torch.full_like(x[:, 1:], fill)
    return torch.cat([row, rest.to(row.dtype)], dim=1)


def _row_kernels(x, dtype, layer_norm_dtype):
    """``(residual_layer_norm, gelu_bias_backward, column_sums, first_row_attention)`` kernel modules where the
    training row applies to this call (`layers.training`'s fused conditions: CUDA, an fp32 layer under 16-bit
    autocast, its row count), else None."""
    fused = training.fusion(x.reshape(-1, x.shape[-1]), dtype, layer_norm_dtype)
    attend = fused_kernels("first_row_attention") if fused is not None and attention.FUSED else None
    return None if attend is None else (*fused, attend)


def _training_row(layer, x, mask, packed=None, input_only=False):
    """Row 0 of the layer's output ([B, 1, D]) by `_TrainingRow` where it applies (module docstring), else None.
    `packed`: ``(plan, keys, starts)`` where x is packed rows [1, N, D] (`_packed`); `input_only`: a pass that takes
    no parameter gradient (`INPUT_ONLY_ROW`), with or without gradients enabled."""
    for name, value in (("TRAINING_ROW", TRAINING_ROW), ("INPUT_ONLY_ROW", INPUT_ONLY_ROW)):
        if value is not True and value is not False:
            raise ValueError(f"cat_fast.layers.first_token.{name}: expected True or False, got {value!r}")
    on = INPUT_ONLY_ROW if input_only else TRAINING_ROW and torch.is_grad_enabled()
    if not on or not isinstance(x, torch.Tensor) or x.dim() != 3:
        return None
    params = training.parameters(layer)
    if params is None or interventions.active(layer):
        return None
    first = params[0]
    if (x.dtype != torch.float32 or x.device != first.device or x.shape[1] == 0
            or any(p.dtype != first.dtype or p.device != first.device for p in params)
            or not (input_only or x.requires_grad or any(p.requires_grad for p in params))):
        return None
    sa, so, inter, out = bert_parts(layer)
    dtype = layout.compute_dtype(x, first.dtype)
    if dtype is None or training.gelu_approximate(inter) != "none" or None in (dropout_p(so.dropout),
                                                                               dropout_p(out.dropout)):
        return None
    kernels = _row_kernels(x, dtype, params[8].dtype)
    if kernels is None:
        return None
    if packed is not None:
        bias, packed = None, packed[1:]
    else:
        B, T, _ = x.shape
        bias = attention.score_bias(_first_row_mask(mask, dtype), B, sa.num_attention_heads, T, x.device)
        if bias is False:
            return None
    with torch.autocast(x.device.type, enabled=False):
        return _TrainingRow.apply(x, bias, packed, layer, dtype, kernels, *params)


def _dropout(x, p):
    """`layout.dropout` (the modules' draws) with its keep mask as a boolean tensor, as the fused kernels take it
    (off CUDA `layout.dropout` gives the scaled Bernoulli noise, nonzero where kept)."""
    out, keep = dropout(x, p)
    return out, keep if keep is None or keep.dtype == torch.bool else keep != 0


class _TrainingRow(torch.autograd.Function):
    """Row 0 of a Bert-layout layer's output, [B, 1, D] fp32, from its input x [B, T, D], or with `packed` =
    ``(keys, starts)`` (`_packed`) from packed rows x [1, N, D] (module docstring): differentiable w.r.t. x and
    the sixteen parameters (`layers.training`'s order); not twice differentiable."""

    @staticmethod
    def forward(ctx, x, bias, packed, layer, dtype, kernels, *params):
        wq, bq, wk, bk, wv, bv, wo, bo, g1, be1, wi, bi, wo2, bo2, g2, be2 = params
        rln, _, _, attend = kernels
        sa, so, inter, out = bert_parts(layer)
        D = x.shape[-1]
        heads, HD = sa.num_attention_heads, wq.shape[0]
        p_attn = sa.dropout.p if sa.training else 0.0
        p1, p2 = dropout_p(so.dropout), dropout_p(out.dropout)
        w16 = casts.weights(layer, (wq, wk, wv, bq, bk, bv, wo, bo, wi, bi, wo2, bo2), dtype)
        x16 = copy16(x, dtype).reshape(-1, D)
        kv = torch.addmm(w16.qkv_bias[HD:], x16, w16.qkv[HD:].t())
        if packed is None:  # x [B, T, D]
            B, T, _ = x.shape
            rows = starts = None
            first16 = x16.view(B, T, D)[:, 0]  # row 0 of each sequence (strided)
            kv = kv.view(B, T, -1)
            residual = x[:, 0].contiguous()  # saved: not a view that would keep the whole input alive
        else:  # x [1, N, D], the packed rows; row 0 of sequence b at starts[b]
            rows, starts = packed
            B, T = starts.numel(), rows[3]
            first16 = x16.index_select(0, starts)
            residual = x.reshape(-1, D).index_select(0, starts)
        q = torch.addmm(w16.qkv_bias[:HD], first16, w16.qkv[:HD].t()).view(B, 1, HD)
        k, v = kv[..., :HD], kv[..., HD:]
        keep = attention.keep_mask(B, heads, T, x.device, p_attn)  # as `attention.first_row` draws it
        inv_keep = 1.0 / (1.0 - p_attn)
        context, attended = attend.forward(q, k, v, bias, keep, heads, sa.scaling, inv_keep, rows)
        context = context.view(B, HD)
        a, keep1 = _dropout(torch.addmm(w16.attention_output_bias, context, w16.attention_output.t()), p1)
        h1, h1_16, mean1, rstd1 = rln.forward(a, residual, g1, be1, so.LayerNorm.eps, out16_dtype=dtype)
        inner = torch.addmm(w16.intermediate_bias, h1_16, w16.intermediate.t())
        activated = torch.nn.functional.gelu(inner)
        o, keep2 = _dropout(torch.addmm(w16.output_bias, activated, w16.output.t()), p2)
        y, _, mean2, rstd2 = rln.forward(o, h1, g2, be2, out.LayerNorm.eps)
        saved = dict(x16=x16, q=q, kv=kv, keep=keep, context=context, a=a, keep1=keep1, residual=residual,
                     mean1=mean1, rstd1=rstd1, h1=h1, h1_16=h1_16, inner=inner, activated=activated, o=o,
                     keep2=keep2, mean2=mean2, rstd2=rstd2, g1=g1, g2=g2, w_qkv=w16.qkv, wo16=w16.attention_output,
                     wi16=w16.intermediate, wo2_16=w16.output, first16=first16, starts=starts)
        ctx.save_for_backward(*saved.values(), *attended)
        ctx.names = tuple(saved)
        ctx.kernels, ctx.params, ctx.rows, ctx.x_shape = kernels, params, rows, x.shape
        ctx.shapes = (B, T, D, heads, HD, p1, p2, sa.scaling, inv_keep, wq.dtype, (wq.shape[0], wk.shape[0],
                                                                                  wv.shape[0]))
        return y.view(B, 1, D)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        tensors = ctx.saved_tensors
        t = dict(zip(ctx.names, tensors))
        attended = tensors[len(ctx.names):]
        B, T, D, heads, HD, p1, p2, scale, inv_keep, p_dtype, qkv_sizes = ctx.shapes
        rln, gelu, sums, attend = ctx.kernels
        need = training.wanted(ctx.needs_input_grad[6:], ctx.params)
        with torch.autocast(grad_y.device.type, enabled=False):
            grad_s2, grad_o, grad_g2, grad_be2, grad_bo2 = training.norm_backward(
                rln, grad_y.reshape(B, D), t["o"], t["h1"], t["g2"], t["mean2"], t["rstd2"], t["keep2"], p2,
                need[13:16])
            grad_wo2 = training.weight_grad(grad_o, t["activated"], p_dtype) if need[12] else None
            grad_inner, grad_bi = gelu.backward(torch.mm(grad_o, t["wo2_16"]), t["inner"], want_bias=need[11])
            grad_wi = training.weight_grad(grad_inner, t["h1_16"], p_dtype) if need[10] else None
            grad_h1 = training.mm_into(grad_s2, grad_inner, t["wi16"])
            grad_s1, grad_a, grad_g1, grad_be1, grad_bo = training.norm_backward(
                rln, grad_h1, t["a"], t["residual"], t["g1"], t["mean1"], t["rstd1"], t["keep1"], p1, need[7:10])
            grad_wo = training.weight_grad(grad_a, t["context"], p_dtype) if need[6] else None
            kv, rows = t["kv"], ctx.rows
            grad_kv = torch.empty_like(kv) if rows is None else torch.zeros_like(kv)  # packed: keys' rows written
            dq, _, _ = attend.backward(torch.mm(grad_a, t["wo16"]).view(B, 1, HD), t["q"], kv[..., :HD],
                                       kv[..., HD:], t["keep"], attended, heads, scale, inv_keep, grad_kv[..., :HD],
                                       grad_kv[..., HD:], rows)
            dq, grad_kv = dq.view(B, HD), grad_kv.view(-1, kv.shape[-1])
            x16, w_qkv, first16 = t["x16"], t["w_qkv"], t["first16"]
            wq_wk_wv = bq_bk_bv = (None,) * 3  # the query's from row 0, the keys' and values' from every row
            if any(need[0:6:2]):
                wq_wk_wv = (training.weight_grad(dq, first16, p_dtype),
                            *training.weight_grad(grad_kv, x16, p_dtype).split(qkv_sizes[1:]))
            if any(need[1:6:2]):
                bq_bk_bv = (sums.column_sums(dq.unsqueeze(0), HD)[0],
                            *sums.column_sums(grad_kv.unsqueeze(0), grad_kv.shape[1])[0].split(qkv_sizes[1:]))
            grad_x = None
            if ctx.needs_input_grad[0]:
                grad_x = layout.mm_at(grad_kv, w_qkv[HD:], torch.float32)
                grad_first = training.mm_into(grad_s1, dq, w_qkv[:HD])
                if rows is None:
                    grad_x = grad_x.view(B, T, D)
                    grad_x[:, 0] += grad_first
                else:
                    grad_x = grad_x.index_add_(0, t["starts"], grad_first).view(ctx.x_shape)
        grads_qkv = training.qkv_grads(need, wq_wk_wv, bq_bk_bv)
        return (grad_x, None, None, None, None, None, *grads_qkv, grad_wo, grad_bo, grad_g1, grad_be1, grad_wi, grad_bi,
                grad_wo2, grad_bo2, grad_g2, grad_be2)
