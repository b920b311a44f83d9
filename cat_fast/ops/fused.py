"""Kernels that are not op backends, for the layers and objectives above `ops` (their only way to a kernel module).

`fused_kernels(name)`: the Triton module `cat_fast.kernels.triton.<name>` of one of `FUSED_KERNELS` —
``residual_layer_norm`` and ``gelu_bias_backward`` / ``column_sums`` (`layers.resumed`, `layers.training`),
``first_row_attention`` (`layers.attention`), ``attention`` (`layers.double_attention`), ``double_backward``
(`layers.double_layers`), ``pooled_gs_loss`` (`objectives.gs`), ``embedding_backward`` (`layers.embedding`),
``row_exchange`` (`gradient_averaging`) — or None where Triton cannot be imported.
`gs_partners` and `weighted_cosine_loss`: the pieces of the pooled GS loss in plain PyTorch;
`layer_norm_double_backward` and `gelu_double_backward`: the backward of LayerNorm's and GELU's backward in plain
PyTorch (`double_backward`'s formulas). `upcast` and `acc_dtype`: the accumulation dtypes every backend shares.
"""
from ..kernels.dtypes import acc_dtype, upcast
from ..kernels.reference.double_backward import reference_gelu as gelu_double_backward
from ..kernels.reference.double_backward import reference_layer_norm as layer_norm_double_backward
from ..kernels.reference.pooled_gs_loss import partners as gs_partners
from ..kernels.reference.pooled_gs_loss import weighted_cosine_loss
from ..kernels.triton import optional

__all__ = ["FUSED_KERNELS", "fused_kernels", "gs_partners", "weighted_cosine_loss", "layer_norm_double_backward",
           "gelu_double_backward", "upcast", "acc_dtype"]

FUSED_KERNELS = ("residual_layer_norm", "gelu_bias_backward", "column_sums", "first_row_attention", "attention",
                 "double_backward", "pooled_gs_loss", "embedding_backward", "row_exchange")


def fused_kernels(name):
    """The Triton kernel module `name` (one of `FUSED_KERNELS`), or None when Triton cannot be imported."""
    if name not in FUSED_KERNELS:
        raise ValueError(f"name: expected one of {FUSED_KERNELS}, got {name!r}")
    return optional(name)
