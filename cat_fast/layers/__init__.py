"""Fast Bert-layout encoder layers that the model plumbing (`cat_fast.models`) swaps in for the model's own.

- `layout`: where a layer's parts live, per architecture family (`LAYOUTS`), and the helpers the layers share;
- `training`: a layer as one autograd node with its parameter gradients (training passes);
- `resumed`: a layer differentiated for its input only (CAT's counterfactual passes);
- `first_token`: the last layer computed for the first token only (heads that read row 0);
- `attention`: attention of one query per sequence (the first-token layer's), a fused kernel on CUDA;
- `interventions`: edits of a layer's activations that the model's modules and these layers all apply;
- `casts`: the 16-bit weight copies the layers multiply with, shared by the passes of a step and cast a layer ahead;
- `packing`: the real rows of a padded batch, packed for the training layers (``training.PACKED``), and their
  variable-length attention;
- `embedding`: the embedding tables' weight gradients summed by a fused kernel during a fast training forward.

Each layer's `forward(layer, args, kwargs)` returns None where it does not apply; then the model's layer runs.

Beside them, imported on their own: `double_attention` and `double_layers`, attention, LayerNorm and GELU whose
backward is differentiable by fused kernels (exact GS's double backward).
"""
from . import attention, casts, embedding, first_token, interventions, layout, packing, resumed, training

__all__ = ["attention", "casts", "embedding", "first_token", "interventions", "layout", "packing", "resumed",
           "training"]
