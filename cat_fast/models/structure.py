"""Structure discovery: which modules of a Hugging Face model are its encoder layers, embeddings and head.

`structure(model)` inspects a model once (cached) and returns a `ModelStructure`; unsupported models raise a
``ValueError`` naming the class and why (decoder-only, encoder-decoder, no layer list, other heads, ...).

Compiled models: `unwrap` removes torch.compile's wrapper (``torch.compile(model)``, an ``OptimizedModule``: its
``._orig_mod``) as it removes DistributedDataParallel's, so the model inside is what is inspected, hooked and run.
`uncompiled` sets aside the compiled call of a model compiled in place (``model.compile()``) for the length of a
pass: a compiled graph runs neither the hooks registered after it was traced nor the layer forwards cat_fast
patches in, so cat_fast's passes run the module's own forward, with exactly the uncompiled model's values. A model
whose submodules alone are compiled (``layer.compile()``, accelerate's regional compilation) is refused.
"""
from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ModelStructure", "structure", "num_layers", "unsupported", "check_trainable_forward", "unwrap",
           "orig_module", "compiled_wrapper", "is_compile_wrapper", "is_compiled", "uncompiled"]


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


def is_compile_wrapper(model) -> bool:
    """Whether `model` is torch.compile's wrapper of a module (``torch.compile(module)``: an ``OptimizedModule``)."""
    # no such wrapper exists before torch._dynamo is imported (cat_fast does not import it)
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


def is_compiled(module) -> bool:
    """Whether calling `module` runs a compiled graph: torch.compile's wrapper, or compiled in place
    (``module.compile()``)."""
    return is_compile_wrapper(module) or getattr(module, "_compiled_call_impl", None) is not None


def unwrap(model):
    """The model inside DistributedDataParallel (``.module``) and torch.compile (``._orig_mod``) wrappers, nested in
    any order; any other model unchanged (one compiled in place, ``model.compile()``, is its own module)."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif is_compile_wrapper(model):
            model = model._orig_mod
        else:
            return model


def orig_module(model):
    """`model` without torch.compile's wrappers (their ``._orig_mod``); any other model unchanged (a DDP wrapper is
    kept: its forward is what calling it asks for). cat_fast's passes take their flags (``training``) from it: a
    wrapper's own flag is not updated by ``model.train()``."""
    while is_compile_wrapper(model):
        model = model._orig_mod
    return model


def compiled_wrapper(model):
    """The torch.compile wrapper directly around `unwrap(model)` among `model`'s wrappers (``torch.compile(model)``,
    ``DDP(torch.compile(model))``), else None (``torch.compile(DDP(model))`` compiles the DDP module's forward, not
    the model's)."""
    wrapper = None
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            wrapper, model = None, model.module
        elif is_compile_wrapper(model):
            wrapper, model = model, model._orig_mod
        else:
            return wrapper


@contextmanager
def uncompiled(model):
    """Context manager giving the module to call for a pass whose hooks and patched layer forwards must run:
    `model` without torch.compile's wrappers (``._orig_mod``), with the compiled call that ``model.compile()``
    installed set aside until the block exits (restored on an exception too); the module's own forward then runs,
    as if it had never been compiled. An uncompiled model is given back as it is."""
    model = orig_module(model)
    compiled = getattr(model, "_compiled_call_impl", None)
    if compiled is None:
        yield model
        return
    model._compiled_call_impl = None
    try:
        yield model
    finally:
        model._compiled_call_impl = compiled


def structure(model) -> ModelStructure:
    """Inspect `model` once (cached): its encoder layer list, embedding module and classification head. A model
    wrapped in DistributedDataParallel or torch.compile is inspected through the model inside (`unwrap`); one
    compiled in place is inspected as it is (its passes run `uncompiled`). Refused: a model with a compiled
    submodule (checked when it is first inspected)."""
    model = unwrap(model)
    found = _STRUCTURES.get(model)
    if found is not None:
        return found
    if hasattr(model, "module") and not hasattr(model, "config"):
        unsupported(model, "it wraps another model (.module): pass the underlying Hugging Face model")
    compiled = next((name for name, mod in model.named_modules() if name and is_compiled(mod)), None)
    if compiled is not None:
        unsupported(model, f"its submodule '{compiled}' is compiled (regional compilation or module.compile()): "
                           "cat_fast's passes hook and patch the model's modules, which a compiled submodule's graph "
                           "would not run; compile the whole model instead (torch.compile(model) or model.compile())")
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
