"""The neuron-effect file ``nie.pt`` that ``cat-fast mediation`` writes and ``cat-fast mask`` / ``unlearn`` read: the
effects with the shape and a fingerprint of the model they were measured on, so that they are applied to that model
only.

    nie_file.save(path, effects, model, {"top_k": 700})   # effects: a mediation.NeuronEffects; then metadata
    effects, record = nie_file.load(path, model)      # NieFileError: unreadable, empty, non-finite or another model's

It holds plain dicts, lists, tensors, strings and numbers (``torch.load(path, weights_only=True)`` reads it):
``effects`` {"layer.component": float32 [width]}; ``model_shape`` {"layers": L, "widths": {component: [width of
layers 1..L]}}; ``model_fingerprint``, the sha256 of the model's tensors (names, dtypes, shapes and values, as
`cat_fast.models.pretrained.load_classifier` loads them: float32); ``model_mask``, the neuron mask the model ran
with (JSON of `masking.masked_neurons`, "" for none); and the caller's metadata.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, Optional, Tuple

import torch

from .. import models
from . import masking
from .mediation import NeuronEffects

__all__ = ["NIE_FILE", "NieFileError", "save", "load", "resolve", "model_shape", "describe_shape", "fingerprint"]

NIE_FILE = "nie.pt"


class NieFileError(ValueError):
    """A nie file that cannot be used (for this model): one line naming the file."""


def model_shape(model) -> Dict:
    """``{"layers": L, "widths": {component: [width of layer 1, ..., layer L]}}`` of `model`."""
    n = models.structure(model).num_layers
    return {"layers": n, "widths": {c: [masking.component_width(model, layer, c) for layer in range(1, n + 1)]
                                    for c in models.COMPONENTS}}


def describe_shape(shape: Dict) -> str:
    """`shape` in words: ``2 layers (query 32, ..., intermediate 64, output 32)``."""
    widths = shape.get("widths", {})
    parts = [f"{c} {ws[0]}" if len(set(ws)) == 1 else f"{c} {'/'.join(map(str, ws))}"
             for c, ws in widths.items() if ws]
    return f"{shape.get('layers')} layers ({', '.join(parts)})"


def fingerprint(model) -> str:
    """The sha256 (hex) of `model`'s state dict: every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _mask(model) -> str:
    spec = masking.masked_neurons(model)
    return "" if spec is None else json.dumps(spec, sort_keys=True)


def save(path: str, effects: NeuronEffects, model, meta: Optional[Dict] = None) -> None:
    """Write `effects`, measured on `model`, to `path` with the model's shape, fingerprint and mask, and `meta` (a
    dict of strings, numbers and bools)."""
    record = {"effects": {f"{layer}.{comp}": v.detach().float().cpu() for (layer, comp), v in effects.effects.items()},
              "model_shape": model_shape(model), "model_fingerprint": fingerprint(model), "model_mask": _mask(model)}
    torch.save({**(meta or {}), **record}, path)


def resolve(nie: str) -> str:
    """The nie file of `nie`: the file itself, or ``nie.pt`` in a ``cat-fast mediation`` output directory."""
    return os.path.join(nie, NIE_FILE) if os.path.isdir(nie) else nie


def load(nie: str, model=None) -> Tuple[NeuronEffects, Dict]:
    """``(effects, record)`` from `nie` (a file or a ``cat-fast mediation`` directory). Refuses (`NieFileError`) a
    file that cannot be read, holds no effects or non-finite ones, and, given `model`, one measured on another
    model: another shape, other weights, or another neuron mask."""
    path = resolve(nie)
    if not os.path.isfile(path):
        raise NieFileError(f"{nie}: no {NIE_FILE} (write it with cat-fast mediation)")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        effects = {(int(key.split(".")[0]), key.split(".", 1)[1]): v.float().reshape(-1)
                   for key, v in saved["effects"].items()}
    except Exception as error:
        raise NieFileError(f"{path}: cannot read it ({type(error).__name__}: {error})") from error
    if not effects or all(v.numel() == 0 for v in effects.values()):
        raise NieFileError(f"{path}: no neuron effects in it (rerun cat-fast mediation)")
    table = NeuronEffects(effects, int(saved.get("target_class", 0)), int(saved.get("samples", 0)))
    values, names = table.flat()
    bad = torch.nonzero(~torch.isfinite(values)).flatten()
    if bad.numel():
        layer, comp, index = names[int(bad[0])]
        raise NieFileError(f"{path}: {bad.numel()} non-finite effects (NaN or inf; the first: layer {layer} {comp} "
                           f"neuron {index}): rerun cat-fast mediation")
    if model is not None:
        _check_model(path, saved, effects, model)
    return table, saved


def _check_model(path: str, saved: Dict, effects: Dict, model) -> None:
    shape = model_shape(model)
    theirs = saved.get("model_shape")
    fits = all(comp in shape["widths"] and 1 <= layer <= shape["layers"]
               and v.numel() == shape["widths"][comp][layer - 1] for (layer, comp), v in effects.items())
    if (isinstance(theirs, dict) and theirs != shape) or not fits:
        measured = describe_shape(theirs) if isinstance(theirs, dict) else "effects of " + ", ".join(
            f"layer {layer} {comp} width {v.numel()}" for (layer, comp), v in sorted(effects.items())[:4])
        raise NieFileError(f"{path} was measured on a model of {measured}; this model has {describe_shape(shape)}")
    theirs = saved.get("model_fingerprint")
    if not isinstance(theirs, str):
        raise NieFileError(f"{path} holds no fingerprint of the model it was measured on (an older cat-fast wrote "
                           "it): rerun cat-fast mediation on this model")
    ours = fingerprint(model)
    if theirs != ours:
        raise NieFileError(f"{path} was measured on another model of the same shape (weights sha256 {theirs[:12]}..., "
                           f"this model's {ours[:12]}...): rerun cat-fast mediation on this model")
    theirs, ours = saved.get("model_mask", ""), _mask(model)
    if theirs != ours:
        raise NieFileError(f"{path} was measured with the neuron mask {theirs or 'none'}; this model runs with "
                           f"{ours or 'none'}: rerun cat-fast mediation on this model")
