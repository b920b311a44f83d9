"""Triton kernels of cat_fast (the ``triton`` backend).

One module per op family; each exposes plain Python launchers with the names and argument order of
the kernel-op schemas (``csrc/cpu/<op>.cpp``; contracts: ``docs/KERNELS.md``):

- ``cmix``: ``cmix_forward``, ``cmix_backward``
- ``cal_objective``: ``cal_objective_forward``, ``cal_objective_backward``
- ``cal_step``: ``cal_step_``
- ``crm_loss``: ``crm_loss_forward``, ``crm_loss_backward``
- ``gs_cosine_loss``: ``gs_row_dots``, ``gs_row_combine``
- ``sample_characteristics``: ``sample_characteristics_forward``, ``sample_characteristics_backward``

and kernels that are not op backends: ``residual_layer_norm`` (residual add + LayerNorm forward and backward, the
latter optionally with the LayerNorm and branch-bias gradients, for `cat_fast.layers.resumed` and
`cat_fast.layers.training`), ``gelu_bias_backward`` (GELU backward + the bias gradient, for `layers.training`),
``column_sums`` (the partial sums of those two; a bias gradient's sums; the join of attention's dq, dk and dv with
their bias gradient, for `cat_fast.layers.packing`), ``embedding_backward`` (an embedding table's weight gradient,
for `cat_fast.layers.embedding`), ``first_row_attention`` (attention of one
query per sequence, forward and backward, for `cat_fast.layers.attention`, the first-token layer's),
``attention`` (attention with a differentiable backward, for `cat_fast.layers.double_attention`),
``double_backward`` (the backward of LayerNorm's and GELU's backward, for `cat_fast.layers.double_layers`),
``pooled_gs_loss`` (gradient supervision on the pooled representation of a linear head, loss and weight gradient in
one launch, for `cat_fast.objectives.gs`) and ``row_exchange`` (the two-GPU average of an embedding table's gradient
by its nonzero rows, for `cat_fast.gradient_averaging`).

Importing a submodule imports triton; this package file itself does not (`optional` imports one on demand).
"""
import functools
import importlib


@functools.cache
def optional(name):
    """The kernel module `name` of this package, or None when it cannot be imported (no Triton)."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError:
        return None
