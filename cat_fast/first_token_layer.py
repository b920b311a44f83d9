"""The last encoder layer computed for the first token only (part of `cat_fast.models`; `resumed_layer` shares its
layout checks).

A sequence classifier's head reads one row of the last layer's output: BERT's pooler, DistilBERT's
pre-classifier, the RoBERTa / ELECTRA / XLM-R classification heads all take ``last_hidden_state[:, 0]``. The
other T − 1 rows of the last layer are dead work: the last layer needs the keys and values of every token, then
the attention of query row 0, the attention output, both layer norms and the feed-forward block of row 0 only
(2·T·D² + 10·D² of the layer's 12·T·D² multiply-adds per sample, with the feed-forward width 4·D).

The keys and values are formed by the layer's own projections and the attention is one SDPA call, on purpose:
folding the key projection into the query and applying the value projection after the weighted sum (two
[H, D] × [D, T] products per sample in place of the two T × D × D projections) was built and measured on an H100
(`benchmarks/RESULTS.md`, item 24). Its dozen extra small fp32 ops and their backward cost 0.9 ms of host time
per training call at 8 × 128 and 1.1 ms per call at 64 × 256, more than the FLOPs it saved.

Supported layers (post-LN, SDPA or eager attention, a 4-D or absent attention mask): the Bert layout
(``attention.self.{query,key,value}``, ``attention.output``, ``feed_forward_chunk``: BERT, RoBERTa, ELECTRA,
XLM-R, CamemBERT, MiniLM) and DistilBERT's ``TransformerBlock``; anything else runs the full layer. The layer's
own submodules compute the query, key and value projections, the attention output block and the feed-forward
block (so forward hooks on them run, on the rows computed); the attention of row 0 is SDPA with the layer's
mask, scale and dropout probability (the same math as both of Hugging Face's kernels).

`models.first_token_ok` checks a model once (see there) before this path is used: that its head reads nothing
but row 0, and that this layer gives the full layer's row 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["supported", "forward"]

_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class _Layout:
    attention: nn.Module  # has the head count / width / scaling / attention dropout
    query: nn.Linear
    key: nn.Linear
    value: nn.Linear
    heads: int
    width: int
    finish: Callable  # (context [B, 1, D], input row [B, 1, D]) -> the layer's output row


def _bert(layer):
    sa = layer.attention.self
    attended = layer.attention.output
    return _Layout(sa, sa.query, sa.key, sa.value, sa.num_attention_heads, sa.attention_head_size,
                   lambda context, first: layer.feed_forward_chunk(attended(context, first)))


def _distilbert(layer):
    sa = layer.attention

    def finish(context, first):
        attended = layer.sa_layer_norm(sa.out_lin(context) + first)
        return layer.output_layer_norm(layer.ffn(attended) + attended)

    return _Layout(sa, sa.q_lin, sa.k_lin, sa.v_lin, sa.n_heads, sa.attention_head_size, finish)


def _is_linear(module, *names):
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def _layout(layer):
    attention = getattr(layer, "attention", None)
    sa = getattr(attention, "self", None)
    if (sa is not None and getattr(attention, "output", None) is not None and _is_linear(sa, "query", "key", "value")
            and callable(getattr(layer, "feed_forward_chunk", None))
            and not getattr(layer, "is_decoder", False) and not getattr(layer, "add_cross_attention", False)
            and getattr(layer, "chunk_size_feed_forward", 0) == 0
            and all(hasattr(sa, n) for n in ("num_attention_heads", "attention_head_size"))):
        return _bert(layer)
    ffn = getattr(layer, "ffn", None)
    if (attention is not None and _is_linear(attention, "q_lin", "k_lin", "v_lin", "out_lin")
            and all(isinstance(getattr(layer, n, None), nn.LayerNorm) for n in ("sa_layer_norm", "output_layer_norm"))
            and ffn is not None and getattr(ffn, "chunk_size_feed_forward", 0) == 0
            and all(hasattr(attention, n) for n in ("n_heads", "attention_head_size"))):
        return _distilbert(layer)
    return None


def _layout_ok(layout):
    a = layout.attention
    config = getattr(a, "config", None)
    return (getattr(config, "_attn_implementation", None) in _ATTENTION
            and getattr(config, "position_embedding_type", "absolute") == "absolute"
            and not getattr(a, "is_causal", False)
            and isinstance(getattr(a, "dropout", None), nn.Dropout) and hasattr(a, "scaling"))


def supported(layer: nn.Module) -> bool:
    """Whether `layer` has a layout this module knows (see the module docstring)."""
    layout = _layout(layer)
    return layout is not None and _layout_ok(layout)


def _call_arguments(args, kwargs):
    """(hidden_states [B, T, D], attention_mask: None or 4-D over T keys) of a layer call, or None when the call
    passes anything else."""
    names = ("hidden_states", "attention_mask", "encoder_hidden_states")
    if len(args) > len(names):
        return None
    values = dict(zip(names, args))
    values.update(kwargs)
    extra = {k: v for k, v in values.items() if k not in names[:2]}
    if any(v is not None and v is not False for v in extra.values()):
        return None  # cross-attention inputs, caches, attention outputs requested...
    x, mask = values.get("hidden_states"), values.get("attention_mask")
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return None
    if mask is not None and (mask.dim() != 4 or mask.shape[-1] != x.shape[1]):
        return None
    return x, mask


def forward(layer: nn.Module, args, kwargs, fill: float | None = None):
    """Row 0 of `layer(*args, **kwargs)`, as a [B, T, D] tensor whose rows 1.. are the layer's input rows
    (detached; nothing reads them) or, with `fill`, that constant; None when the layer or this call cannot be
    handled (then run the layer itself)."""
    layout = _layout(layer)
    if layout is None or not _layout_ok(layout):
        return None
    found = _call_arguments(args, kwargs)
    if found is None:
        return None
    x, mask = found
    B, T, _ = x.shape
    heads, width = layout.heads, layout.width
    first = x[:, :1]
    q = layout.query(first).view(B, 1, heads, width).transpose(1, 2)
    k = layout.key(x).view(B, T, heads, width).transpose(1, 2)
    v = layout.value(x).view(B, T, heads, width).transpose(1, 2)
    if mask is not None and mask.shape[-2] != 1:
        mask = mask[:, :, :1]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    attention = layout.attention
    p = attention.dropout.p if attention.training else 0.0
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=attention.scaling)
    row = layout.finish(context.transpose(1, 2).reshape(B, 1, heads * width), first)
    rest = x[:, 1:].detach() if fill is None else torch.full_like(x[:, 1:], fill)
    return torch.cat([row, rest.to(row.dtype)], dim=1)
