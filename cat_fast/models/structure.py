"""Structure discovery: which modules of a Hugging Face model are its encoder layers, embeddings and head.

`structure(model)` inspects a model once (cached) and returns a `ModelStructure`; unsupported models raise a
``ValueError`` naming the class and why (decoder-only, encoder-decoder, no layer list, other heads, ...).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ModelStructure", "structure", "num_layers", "unsupported", "check_trainable_forward", "unwrap"]


@dataclass(frozen=True)
class ModelStructure:
    """What cat_fast needs to know about a model; computed once per model by `structure`."""

    model_class: str
    layer_list_name: str
    layer_modules: tuple  # unique modules of the layer list, in list order
    num_layers: int  # number of layer CALLS per forward (L)
    embeddings: nn.Module | None
    head: nn.Module
    head_name: str
    task: str  # "sequence_classification" | "question_answering"
    checkpoint_flags: tuple = ()  # modules with a `gradient_checkpointing` attribute (Hugging Face's switch)


_STRUCTURES: "weakref.WeakKeyDictionary[nn.Module, ModelStructure]" = weakref.WeakKeyDictionary()


def unsupported(model, why):
    raise ValueError(f"cat_fast does not support {type(model).__name__}: {why}")


def _find_layer_list(model, base):
    candidates = []
    for name, mod in base.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        kinds = {type(child) for child in mod}
        if len(kinds) != 1 or not any(True for _ in mod[0].parameters()):
            continue
        candidates.append((name.count("."), name, mod))
    if not candidates:
        unsupported(model, "no nn.ModuleList of encoder layers found under its base model")
    depth = min(c[0] for c in candidates)
    shallowest = [c for c in candidates if c[0] == depth]
    if len(shallowest) > 1:
        names = ", ".join(c[1] for c in shallowest)
        unsupported(model, f"several candidate layer lists ({names}); cannot tell which is the encoder")
    return shallowest[0][1], shallowest[0][2]


def _find_head(model, task):
    if task == "question_answering":
        names = ("qa_outputs",)
        width = 2
    else:
        names = ("classifier", "score")
        width = model.config.num_labels
    for name in names:
        mod = getattr(model, name, None)
        if isinstance(mod, nn.Module):
            return name, mod
    last = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and mod.out_features == width:
            last = (name, mod)
    if last is None:
        unsupported(model, f"no classification projection (nn.Linear with out_features={width}) found")
    return last


def unwrap(model):
    """The model inside a DistributedDataParallel wrapper (``.module``); any other model unchanged."""
    while isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return model


def structure(model) -> ModelStructure:
    """Inspect `model` once (cached): its encoder layer list, embedding module and classification head. A model
    wrapped in DistributedDataParallel is inspected through its ``.module``."""
    model = unwrap(model)
    if getattr(model, "_compiled_call_impl", None) is not None or type(model).__name__ == "OptimizedModule":
        unsupported(model, "it is compiled (torch.compile / model.compile()): cat_fast's passes hook and patch its "
                           "layers every step, which a compiled graph would not run; pass the uncompiled model")
    found = _STRUCTURES.get(model)
    if found is not None:
        return found
    if hasattr(model, "module") and not hasattr(model, "config"):
        unsupported(model, "it wraps another model (.module): pass the underlying Hugging Face model")
    cls = type(model).__name__
    config = getattr(model, "config", None)
    if config is None:
        unsupported(model, "not a Hugging Face PreTrainedModel (no .config)")
    if getattr(config, "is_encoder_decoder", False):
        unsupported(model, "encoder-decoder models are not supported (CAT mixes an encoder layer)")
    causal = [n for n, m in model.named_modules() if getattr(m, "is_causal", False) is True]
    if getattr(config, "is_decoder", False) or causal:
        where = f" (causal attention in {causal[0]})" if causal else ""
        unsupported(model, f"decoder-only / causal models are not supported{where}; use a bidirectional encoder")
    if cls.endswith("ForQuestionAnswering"):
        task = "question_answering"
    elif cls.endswith("ForSequenceClassification"):
        task = "sequence_classification"
    else:
        unsupported(model, "only *ForSequenceClassification and *ForQuestionAnswering heads are supported")
    base = getattr(model, "base_model", model)
    list_name, layer_list = _find_layer_list(model, base)
    unique = []
    for child in layer_list:
        if all(child is not u for u in unique):
            unique.append(child)
    n_layers = getattr(config, "num_hidden_layers", None) or len(layer_list)
    embeddings = getattr(base, "embeddings", None)
    if not isinstance(embeddings, nn.Module):
        embeddings = None
    head_name, head = _find_head(model, task)
    prefix = getattr(model, "base_model_prefix", "")
    found = ModelStructure(
        model_class=cls,
        layer_list_name=f"{prefix}.{list_name}" if prefix and base is not model else list_name,
        layer_modules=tuple(unique),
        num_layers=int(n_layers),
        embeddings=embeddings,
        head=head,
        head_name=head_name,
        task=task,
        checkpoint_flags=tuple(m for m in model.modules() if hasattr(m, "gradient_checkpointing")),
    )
    _STRUCTURES[model] = found
    return found


def num_layers(model) -> int:
    """Number of encoder layer calls L per forward (ALBERT: num_hidden_layers, though one module)."""
    return structure(model).num_layers


def check_trainable_forward(model, st):
    # Hugging Face's is_activation_checkpointing walks every module on each call (~1 ms of host time per
    # step for BERT-base); the modules that carry the flag are found once, in `structure`.
    if any(getattr(m, "gradient_checkpointing", False) is True for m in st.checkpoint_flags):
        unsupported(model, "gradient checkpointing re-runs layer forwards during backward; disable it for CAT/GS")
