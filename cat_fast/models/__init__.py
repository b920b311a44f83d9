"""Everything cat_fast knows about a Hugging Face model: the only package that looks inside one.

- `structure(model)`: the encoder layer list, embeddings and classification head (`structure`);
- `capture` / `resume`: ``h_m`` of a batch from the model's own forward, and the model resumed from ``h̃`` at layer m
  with the clean forward's dropout masks (`capture`); `head_logits`, `grad_wrt_pooled` for the pooled vector;
- `first_token_ready` / `first_token_forward`: the last layer for row 0 only where the head reads nothing else;
- `model_inputs`, `sync_free_inputs`, `logits_of`: what the forward takes and gives (`inputs`);
- `intervene(model, layer, component, fn)`: edit a layer's activations on every path (`interventions`);
- `graph_capture(graph, pool)`: a CUDA-graph capture of a model: autocast's weight cache emptied around it, eager
  attention masks built without a host copy (`masks`);
- `load_classifier`: a sequence classifier and its tokenizer from a local directory or the shipped MiniLM
  (`pretrained`, imported on use).

No modeling file is imported: models are driven through their own ``forward`` with hooks. A compiled model is
driven the same way: the passes above run the module inside torch.compile's wrapper (`orig_module`), with the
compiled call of a model compiled in place set aside (`uncompiled`), so they compute exactly what the uncompiled
model computes.
"""
from .capture import Capture, capture, grad_wrt_pooled, head_logits, resume
from .first_token import first_token_forward, first_token_ok, first_token_ready
from .inputs import TARGET_KEYS, logits_of, model_inputs, sync_free_inputs
from .interventions import COMPONENTS, intervene
from .masks import capture_safe_masks, graph_capture
from .rng import PassGenerators
from .rng import get_state as get_rng_state
from .rng import set_state as set_rng_state
from .structure import (
    ModelStructure,
    compiled_wrapper,
    is_compiled,
    num_layers,
    orig_module,
    structure,
    uncompiled,
    unwrap,
)

__all__ = [
    "ModelStructure", "Capture", "structure", "unwrap", "orig_module", "compiled_wrapper", "is_compiled",
    "uncompiled", "num_layers", "capture", "resume", "first_token_ok", "first_token_ready",
    "first_token_forward", "head_logits", "grad_wrt_pooled", "logits_of", "model_inputs", "sync_free_inputs",
    "TARGET_KEYS", "intervene", "COMPONENTS", "capture_safe_masks", "graph_capture", "get_rng_state",
    "set_rng_state", "PassGenerators",
]
