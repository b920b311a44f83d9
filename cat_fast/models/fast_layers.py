"""Running a model's encoder layers as cat_fast's fast layers (`cat_fast.layers`) for the length of a forward:
`training_layers` (every layer as `layers.training`) and `last_layer_first_token` (the last layer for row 0 only,
once `models.first_token_ok` has accepted the model). Both fall back to the model's own layer call by call."""
from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager

import torch
from torch import nn

from .. import layers
from .patching import formatted, output_format, patch_forward, unpatch_forward, wants_all_outputs

__all__ = ["training_layers", "carry_set", "unpacked", "last_layer_first_token", "first_token_known",
           "record_first_token", "AdapterWarning", "warn_adapters"]


_FIRST_TOKEN: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


# The format of the last layer's output (None: a tensor; n: a tuple of n whose items after the first are None),
# recorded by the check so that a forward can return its first-token row in that format.
_LAST_FORMAT: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()


# The format of a layer's output for `training_layers` (as `_LAST_FORMAT`; False: not a format it can give),
# recorded from the model's own layer on the first training forward of each model.
_LAYER_FORMAT: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()


@contextmanager
def training_layers(model, st, inputs, enabled, carry: bool = False, own_hooks=()):
    """While active, the encoder layers run `layers.training` (one autograd node per layer: the same values, dropout
    draws and gradients with less host work) where it supports the layer and the call; the rest run themselves
    (a first-token last layer, patched inside this, falls back to this). Off when the call asks for hidden states
    or attentions.

    `carry`: with the packed path on (`layers.training.PACKED`), the layers before the last hand their outputs
    on packed (`layers.packing.carry`: the real rows only, packed once per forward and unpacked once, by the last
    layer, which a first-token last layer reads packed) where nothing else can read them: no forward hooks on the
    layers but the caller's `own_hooks` (their handles' ids: hooks that take packed outputs, as `capture`'s), no
    gradient checkpointing. A layer that cannot run packed gets its input unpacked."""
    if not enabled or wants_all_outputs(model, inputs) or _LAYER_FORMAT.get(model) is False:
        yield
        return
    modules = st.layer_modules
    if not any(layers.training.supported(mod) for mod in modules):
        warn_adapters(model, modules)
        yield
        return
    def layer_forward(mod, orig):
        def forward(*args, **kwargs):
            fmt = _LAYER_FORMAT.get(model, "unknown")
            if fmt == "unknown":
                hidden = args[0] if args else kwargs.get("hidden_states")
                cuda = isinstance(hidden, torch.Tensor) and hidden.is_cuda
                if cuda and torch.cuda.is_current_stream_capturing():  # no generator state to restore in a capture
                    out = orig(*args, **kwargs)
                    _LAYER_FORMAT[model] = output_format(out)
                    return out
                # the model's own layer runs once for its output format, its random draws undone, so that this
                # forward draws what every later one draws (`models.PassGenerators` measures a step's draws)
                with torch.random.fork_rng(devices=[hidden.get_device()] if cuda else []), torch.no_grad():
                    out = orig(*args, **kwargs)
                fmt = _LAYER_FORMAT[model] = output_format(out)
                if fmt is False:
                    return orig(*args, **kwargs)
            y = layers.training.forward(mod, args, kwargs)
            if y is None:
                return orig(*unpacked(args), **unpacked(kwargs))
            return formatted(fmt, y)

        return forward

    carried = carry_set(model, st, modules, own_hooks) if carry else None
    patched = [patch_forward(mod, layer_forward(mod, mod.forward)) for mod in modules]
    try:
        # each layer's 16-bit weight copies are cast on a side stream while the layer before runs; the embedding
        # tables' weight gradients are summed by cat_fast's kernel
        with layers.packing.carrying(carried), layers.embedding.lookups(st.embeddings):
            with layers.casts.ahead(modules, layers.layout.bert_projections, _rows(inputs)):
                yield
    finally:
        for saved in reversed(patched):
            unpatch_forward(saved)


def _rows(inputs) -> int | None:
    """Batch x length of a model call: of its ``input_ids`` [B, T], ``inputs_embeds`` [B, T, D] or attention mask
    ([B, T], or 4-D over T keys); None where it passes none of them."""
    for name, length_dim in (("input_ids", -1), ("inputs_embeds", 1), ("attention_mask", -1)):
        value = inputs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.shape[0] * value.shape[length_dim]
    return None


def carry_set(model, st, modules, own_hooks=()):
    """The layers of `modules` (consecutive encoder layers, the model's last at their end) whose outputs may stay
    packed for the next (`layers.packing.carrying`): all but the last, where the packed path is on, no hooks on
    the layers (or global ones) would read them but those whose handle ids are in `own_hooks`, and no gradient
    checkpointing; else None."""
    mm = nn.modules.module
    own = frozenset(own_hooks)
    ok = (layers.training.packed_mode() and len(modules) > 1 and _format_known(model)
          and not (mm._global_forward_hooks or mm._global_forward_pre_hooks)
          and not any(set(m._forward_hooks).union(m._forward_pre_hooks) - own for m in modules)
          and not any(getattr(m, "gradient_checkpointing", False) is True for m in st.checkpoint_flags))
    return frozenset(modules[:-1]) if ok else None


def _format_known(model) -> bool:
    """Whether the layers' output format is recorded (the first training forward records it, unpacked)."""
    return _LAYER_FORMAT.get(model, "unknown") not in ("unknown", False)


def unpacked(values):
    """`values` (args tuple or kwargs dict) with a packed layer output (`layers.packing.carried`) unpacked."""
    items = values.items() if isinstance(values, dict) else enumerate(values)
    found = [(k, layers.packing.carried(v)) for k, v in items]
    if not any(c for _, c in found):
        return values
    out = dict(values) if isinstance(values, dict) else list(values)
    for k, c in found:
        if c is not None:
            out[k] = layers.packing.unpack(out[k], *c)
    return out if isinstance(values, dict) else tuple(out)


@contextmanager
def last_layer_first_token(model, st, inputs, enabled):
    """While active, the last layer's forward returns its first-token row (`layers.first_token.forward`) when
    `first_token_ready` accepted the model and the call does not ask for hidden states or attentions."""
    if not enabled or wants_all_outputs(model, inputs) or _FIRST_TOKEN.get(model) is not True:
        yield
        return
    mod = st.layer_modules[-1]
    orig, fmt = mod.forward, _LAST_FORMAT.get(model)

    def forward(*args, **kwargs):
        row = layers.first_token.forward(mod, args, kwargs)
        return orig(*unpacked(args), **unpacked(kwargs)) if row is None else formatted(fmt, row)

    saved = patch_forward(mod, forward)
    try:
        yield
    finally:
        unpatch_forward(saved)


_WARNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


class AdapterWarning(UserWarning):
    """A model's adapter-wrapped projections (peft) that the fast layers cannot read as one weight keep them off: its
    layers run their own code. peft's LoRA Linears they read as W + scaling · B @ A (`layers.layout.projection`) where
    `layers.layout.lora_refusal` allows: one active adapter, no dropout in training mode, no DoRA, not merged."""


def warn_adapters(model, modules) -> None:
    """Warn once per model when adapter-wrapped projections (peft) are what keeps the fast layers off, naming why."""
    if model in _WARNED:
        return
    reasons = sorted({why for mod in modules for why in map(layers.layout.lora_refusal, mod.modules()) if why})
    if reasons:
        _WARNED.add(model)
        warnings.warn(AdapterWarning(
            f"cat_fast: the encoder's projections are wrapped by peft in a way the fast training and first-token "
            f"layers (cat_fast.layers) do not read ({'; '.join(reasons)}), so every encoder layer runs its own code, "
            "slower (they read LoRA Linears with one active adapter, no dropout in training, no DoRA; or merge the "
            "adapters, peft's merge_and_unload(), to train the merged model fast)"), stacklevel=3)


def first_token_known(model, st):
    """The cached decision for `model`, False (cached) when its layout is not supported, else None."""
    known = _FIRST_TOKEN.get(model)
    if known is None and not (st.task == "sequence_classification" and len(st.layer_modules) == st.num_layers
                              and layers.first_token.supported(st.layer_modules[-1])):
        known = _FIRST_TOKEN[model] = False
        warn_adapters(model, st.layer_modules[-1:])
    return known


def record_first_token(model, ok: bool, fmt=None) -> None:
    """Remember the first-token decision for `model` (and, when accepted, its last layer's output format)."""
    if ok:
        _LAST_FORMAT[model] = fmt
    _FIRST_TOKEN[model] = ok
