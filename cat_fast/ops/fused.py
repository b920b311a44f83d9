"""Kernels that are not op backends, for the layers and objectives above `ops` (their only way to a kernel module).

`fused_kernels(name)`: the Triton module `cat_fast.kernels.triton.<name>` of one of `FUSED_KERNELS` —
``residual_layer_norm`` and ``gelu_bias_backward`` / ``column_sums`` (`layers.resumed`, `layers.training`),
``first_row_attention`` (`layers.attention`), ``attention`` (`layers.double_attention`), ``double_backward``
(`layers.double_layers`), ``pooled_gs_loss`` (`objectives.gs`), ``embedding_backward`` (`layers.embedding`),
``row_exchange`` (`gradient_averaging`), ``varlen_attention`` (`layers.packing`) — or None where Triton cannot be
imported.
`gs_partners` and `weighted_cosine_loss`: the pieces of the pooled GS loss in plain PyTorch;
`layer_norm_double_backward` and `gelu_double_backward`: the backward of LayerNorm's and GELU's backward in plain
PyTorch (`double_backward`'s formulas). `upcast` and `acc_dtype`: the accumulation dtypes every backend shares.
`rng_offset`: a CUDA generator's offset, read inside a CUDA-graph capture too (the extension's, CUDA builds).
"""
import functools

import torch

from ..kernels.dtypes import acc_dtype, upcast
from ..kernels.reference.double_backward import reference_gelu as gelu_double_backward
from ..kernels.reference.double_backward import reference_layer_norm as layer_norm_double_backward
from ..kernels.reference.pooled_gs_loss import partners as gs_partners
from ..kernels.reference.pooled_gs_loss import weighted_cosine_loss
from ..kernels.triton import optional
from . import registry

__all__ = ["FUSED_KERNELS", "fused_kernels", "gs_partners", "weighted_cosine_loss", "layer_norm_double_backward",
           "gelu_double_backward", "upcast", "acc_dtype", "rng_offset",
           "rng_offset_available"]

FUSED_KERNELS = ("residual_layer_norm", "gelu_bias_backward", "column_sums", "first_row_attention", "attention",
                 "double_backward", "pooled_gs_loss", "embedding_backward", "row_exchange", "varlen_attention")


def fused_kernels(name):
    """The Triton kernel module `name` (one of `FUSED_KERNELS`), or None when Triton cannot be imported."""
    if name not in FUSED_KERNELS:
        raise ValueError(f"name: expected one of {FUSED_KERNELS}, got {name!r}")
    return optional(name)


@functools.cache
def _rng_offset_op():
    """The extension's ``cat_fast::rng_offset``, or None where it was built without CUDA (looked up once)."""
    if not registry.cpp_loaded():
        return None
    try:
        return torch.ops.cat_fast.rng_offset
    except (AttributeError, RuntimeError):
        return None


def rng_offset_available() -> bool:
    """Whether `rng_offset` reads offsets (the extension was built with CUDA)."""
    return _rng_offset_op() is not None


def rng_offset(generator):
    """The Philox offset at which CUDA `generator`'s next draw starts (an int), or None where the extension was built
    without CUDA (csrc/cuda/rng_offset.cu). Outside a CUDA-graph capture: ``generator.get_offset()``. Inside a
    capture that records `generator`, where ``get_offset()`` refuses: the offset within the graph its draws so far
    have reached (a replay adds it to the generator's offset at the replay's start). The difference of two readings
    is, in a capture and out of one, the numbers drawn between them."""
    op = _rng_offset_op()
    return None if op is None else int(op(generator))
