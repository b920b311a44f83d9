"""The last encoder layer computed for the first token only: for heads that read row 0 of the last hidden state
(BERT's pooler, DistilBERT's pre-classifier, the RoBERTa / ELECTRA / XLM-R heads), the other rows are dead work.

``forward(layer, args, kwargs)`` returns the layer's output with row 0 computed (keys and values of every token,
the rest for row 0: about 1/6 of the layer's matmuls) and rows 1.. the layer's input rows, or None where it does
not apply. The layer's own submodules compute the projections and blocks, so forward hooks on them run, on the
rows computed. Supported: the Bert and DistilBERT layouts (`layout.family`), post-LN, SDPA or eager attention,
absolute positions. `models.first_token_ok` checks once per model that the head reads only row 0 and that this
layer gives the full layer's row 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import layout

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


def _layout(layer):
    kind = layout.family(layer)
    if kind == "bert":
        return _bert(layer)
    if kind == "distilbert":
        return _distilbert(layer)
    return None


def _layout_ok(parts):
    a = parts.attention
    config = getattr(a, "config", None)
    return (getattr(config, "_attn_implementation", None) in _ATTENTION
            and getattr(config, "position_embedding_type", "absolute") == "absolute"
            and not getattr(a, "is_causal", False)
            and isinstance(getattr(a, "dropout", None), nn.Dropout) and hasattr(a, "scaling"))


def supported(layer: nn.Module) -> bool:
    """Whether `layer` has a layout this module knows (see the module docstring)."""
    parts = _layout(layer)
    return parts is not None and _layout_ok(parts)


def forward(layer: nn.Module, args, kwargs, fill: float | None = None, row_only: bool = False):
    """Row 0 of `layer(*args, **kwargs)`, as a [B, T, D] tensor whose rows 1.. are the layer's input rows
    (detached; nothing reads them) or, with `fill`, that constant; with `row_only`, as a [B, 1, D] tensor (for
    passes whose only reader is a head that reads row 0: no copy of the other rows, and the head's gradient is
    one row, not a zero-filled sequence). None when the layer or this call cannot be handled (then run the layer
    itself)."""
    parts = _layout(layer)
    if parts is None or not _layout_ok(parts):
        return None
    found = layout.call_arguments(args, kwargs)
    if found is None:
        return None
    x, mask = found
    B, T, _ = x.shape
    heads, width = parts.heads, parts.width
    first = x[:, :1]
    q = parts.query(first).view(B, 1, heads, width).transpose(1, 2)
    k = parts.key(x).view(B, T, heads, width).transpose(1, 2)
    v = parts.value(x).view(B, T, heads, width).transpose(1, 2)
    if mask is not None and mask.shape[-2] != 1:
        mask = mask[:, :, :1]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    attention = parts.attention
    p = attention.dropout.p if attention.training else 0.0
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=attention.scaling)
    row = parts.finish(context.transpose(1, 2).reshape(B, 1, heads * width), first)
    if row_only:
        return row
    rest = x[:, 1:].detach() if fill is None else torch.full_like(x[:, 1:], fill)
    return torch.cat([row, rest.to(row.dtype)], dim=1)
