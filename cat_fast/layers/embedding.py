"""Embedding lookups whose weight gradient is summed by cat_fast's kernel (`kernels.triton.embedding_backward`:
a sort of the ids as int32 and two launches, in a fixed order) rather than PyTorch's CUDA backward (64-bit sorts in a
dozen launches), for the model's embedding tables during a fast training forward (`models.fast_layers`).

``lookups(module)``: while active, the plain ``nn.Embedding`` tables in `module` (dense, no ``max_norm``, no
``scale_grad_by_freq``, no hooks, no forward of their own) look up through `lookup` where the call wants a weight
gradient on CUDA. The forward is ``F.embedding``'s; the weight gradient equals PyTorch's up to the order of fp32
additions (`tests/layers/test_embedding.py`), and a backward that builds a graph (``create_graph``) runs PyTorch's.
`FAST = False` turns it off, for comparisons.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.fused import fused_kernels

__all__ = ["lookup", "lookups", "FAST"]

# Whether `lookups` routes the tables' weight gradients to cat_fast's kernel (module docstring).
FAST = True


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, ids, padding_idx):
        ctx.save_for_backward(ids)
        ctx.num_weights, ctx.padding_idx = weight.shape[0], padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        kernel = fused_kernels("embedding_backward")
        if kernel is None or torch.is_grad_enabled():  # no Triton, or a graph of this backward wanted
            pad = -1 if ctx.padding_idx is None else ctx.padding_idx % ctx.num_weights
            return torch.ops.aten.embedding_dense_backward(grad, ids, ctx.num_weights, pad, False), None, None
        return kernel.backward(grad, ids, ctx.num_weights, ctx.padding_idx), None, None


def lookup(table: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """``table(ids)``, its weight gradient summed by `kernels.triton.embedding_backward`."""
    return _Lookup.apply(table.weight, ids, table.padding_idx)


def _plain(m: nn.Module) -> bool:
    return (type(m) is nn.Embedding and not m.sparse and m.max_norm is None and not m.scale_grad_by_freq
            and "forward" not in m.__dict__ and not (m._forward_hooks or m._forward_pre_hooks))


@contextmanager
def lookups(module: nn.Module | None):
    """While active, the plain CUDA tables in `module` (module docstring) look up through `lookup` where a call
    wants the weight's gradient (grad mode on, the weight requires grad) with integer ids on the table's device; other
    calls run the table's own forward. Nothing changes with `FAST` off, no `module`, or no Triton."""
    if FAST is not True and FAST is not False:
        raise ValueError(f"cat_fast.layers.embedding.FAST: expected True or False, got {FAST!r}")
    tables = [m for m in module.modules() if _plain(m) and m.weight.is_cuda] if module is not None and FAST else []
    if not tables or fused_kernels("embedding_backward") is None:
        yield
        return

    def forward_of(table):
        own = type(table).forward.__get__(table)

        def forward(*args, **kwargs):
            ids = args[0] if len(args) == 1 and not kwargs else kwargs.get("input") if not args else None
            w = table.weight
            if (torch.is_grad_enabled() and w.requires_grad and isinstance(ids, torch.Tensor)
                    and ids.device == w.device and ids.dtype in (torch.int32, torch.int64)):
                return lookup(table, ids)
            return own(*args, **kwargs)

        return forward

    for table in tables:
        table.forward = forward_of(table)
    try:
        yield
    finally:
        for table in tables:
            del table.forward
