"""The last encoder layer computed for the first token only (part of `cat_fast.models`; nothing else imports it).

A sequence classifier's head reads one row of the last layer's output: BERT's pooler, the RoBERTa / ELECTRA /
XLM-R classification heads all take ``last_hidden_state[:, 0]``. The other T − 1 rows of the last layer are dead
work in CAT's counterfactual passes: there, the last layer needs the keys and values of every token but the
query, the attention output, both layer norms and the feed-forward block of row 0 only — about 1/6 of the
layer's matmul FLOPs (the K and V projections) instead of all of it.

Supported layers: the post-LN Bert layout (``attention.self.{query,key,value}``, ``attention.output``,
``feed_forward_chunk``; BERT, RoBERTa, ELECTRA, XLM-R, CamemBERT, MiniLM) with SDPA or eager attention and a
4-D or absent attention mask; anything else runs the full layer. The layer's own submodules compute the
attention output block and the feed-forward block; only the projections, the head split and the attention for
one query row are written here (softmax attention, the same math as both of Hugging Face's kernels).

`models.first_token_ok` checks a model once (see there) before this path is used: that its head reads nothing
but row 0, and that this layer gives the full layer's row 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["supported", "forward"]

_ATTENTION = ("sdpa", "eager")


def supported(layer: nn.Module) -> bool:
    """Whether `layer` has the post-LN Bert layout this module knows (no cross-attention, no FFN chunking)."""
    attention = getattr(layer, "attention", None)
    sa = getattr(attention, "self", None)
    out = getattr(attention, "output", None)
    if sa is None or out is None or not callable(getattr(layer, "feed_forward_chunk", None)):
        return False
    if not all(isinstance(getattr(sa, n, None), nn.Linear) for n in ("query", "key", "value")):
        return False
    if not all(hasattr(sa, n) for n in ("num_attention_heads", "attention_head_size", "scaling", "dropout")):
        return False
    config = getattr(sa, "config", None)
    return (getattr(config, "_attn_implementation", None) in _ATTENTION
            and getattr(config, "position_embedding_type", "absolute") == "absolute"
            and not getattr(sa, "is_causal", False) and not getattr(layer, "is_decoder", False)
            and not getattr(layer, "add_cross_attention", False)
            and getattr(layer, "chunk_size_feed_forward", 0) == 0)


def _call_arguments(args, kwargs):
    """(hidden_states, attention_mask) of a layer call, or None when the call passes anything else."""
    names = ("hidden_states", "attention_mask", "encoder_hidden_states")
    values = dict(zip(names, args))
    if len(args) > len(names):
        return None
    for name, value in kwargs.items():
        values[name] = value
    extra = {k: v for k, v in values.items() if k not in names[:2]}
    if any(v is not None and v is not False for v in extra.values()):
        return None  # cross-attention inputs, caches, attention outputs requested...
    return values.get("hidden_states"), values.get("attention_mask")


def forward(layer: nn.Module, args, kwargs, fill: float | None = None):
    """Row 0 of `layer(*args, **kwargs)`, as a [B, T, D] tensor whose rows 1.. are the layer's input rows
    (detached; nothing reads them) or, with `fill`, that constant; None when this call cannot be handled (then
    run the layer itself)."""
    found = _call_arguments(args, kwargs)
    if found is None or not isinstance(found[0], torch.Tensor) or found[0].dim() != 3:
        return None
    x, mask = found
    if mask is not None and (mask.dim() != 4 or mask.shape[-1] != x.shape[1]):
        return None
    sa = layer.attention.self
    B, T, _ = x.shape
    heads, width = sa.num_attention_heads, sa.attention_head_size
    first = x[:, :1]
    q = sa.query(first).view(B, 1, heads, width).transpose(1, 2)
    k = sa.key(x).view(B, T, heads, width).transpose(1, 2)
    v = sa.value(x).view(B, T, heads, width).transpose(1, 2)
    if mask is not None and mask.shape[-2] != 1:
        mask = mask[:, :, :1]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    p = sa.dropout.p if sa.training else 0.0
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=sa.scaling)
    context = context.transpose(1, 2).reshape(B, 1, heads * width)
    attended = layer.attention.output(context, first)
    row = layer.feed_forward_chunk(attended)
    rest = x[:, 1:].detach() if fill is None else torch.full_like(x[:, 1:], fill)
    return torch.cat([row, rest.to(row.dtype)], dim=1)
