"""Causal-grounded masking (docs/METHODS.md §3): scale the first-token activation of selected neurons.

    from cat_fast.analysis import masking, mediation
    top = nie.top(k)                                       # [(layer, component, neuron, NIE), ...]
    masking.mask_neurons(model, top, factor=0.0)           # every forward of `model` now masks them
    model.save_pretrained(DIR); tokenizer.save_pretrained(DIR)
    masking.write_readme(DIR, model)                       # README.md: how to load it masked
    model, tokenizer = masking.load_masked(DIR)            # the one-line load: the mask comes back with the model

The mask is an intervention (`cat_fast.models.intervene`), so the model's own layers and cat_fast's fast layers all
apply it, in training too (it is differentiable). It acts on position 0 only, as the NIE was measured. The mask is
recorded in ``model.config.cat_fast_neuron_mask`` (saved in config.json by ``save_pretrained``).
`cat_fast.models.pretrained.load_classifier` (every ``cat-fast`` command) applies it, or refuses the model where a
command must not train or re-mask a masked one (``saved_mask="refuse"``: ``train --model``, ``mask``); a model loaded
with ``from_pretrained`` alone runs unmasked until `apply_saved_mask`. transformers has no hook by which a
config.json can mask a model, or even warn, in plain ``from_pretrained`` / ``pipeline`` (``auto_map`` runs code from
the directory under ``trust_remote_code`` only; another ``architectures`` entry breaks the plain load), so a masked
directory says it in its README.md (`write_readme`, written by ``cat-fast mask`` and ``unlearn``) and in the
documented config key. Folding the factor into the weights instead (scaling the
weight row and bias that produce the neuron, or the LayerNorm element of attention_output / output) would scale the
neuron at EVERY position, and for query / key / value change the attention of every token: a different
intervention from the one the NIE measured; it is not offered.
"""
from __future__ import annotations

import math
from typing import Iterable, List, Sequence, Tuple

import torch

from .. import models
from ..models import families

__all__ = ["mask_neurons", "unmask_neurons", "masked_neurons", "apply_saved_mask", "load_masked", "normalise_neurons",
           "component_width", "write_readme", "CONFIG_KEY", "README"]

CONFIG_KEY = "cat_fast_neuron_mask"
_ATTR = "_cat_fast_neuron_masks"  # the open intervention blocks of a masked model


def normalise_neurons(model, neurons) -> List[Tuple[int, str, int]]:
    """`neurons` checked against `model` ((layer, component, index) items, extra fields ignored): sorted, deduplicated
    (layer, component, index) tuples; errors name the bad item."""
    st = models.structure(model)
    widths = {}
    out = []
    for item in neurons:
        if not isinstance(item, (tuple, list)) or len(item) < 3:
            raise ValueError(f"neurons: expected (layer, component, index) items (e.g. NeuronEffects.top(k)), got "
                             f"{item!r}")
        layer, comp, index = item[0], item[1], item[2]
        if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer <= st.num_layers:
            raise ValueError(f"neurons: layer {layer!r} is not in [1, {st.num_layers}]")
        if comp not in models.COMPONENTS:
            raise ValueError(f"neurons: component {comp!r} is not one of {models.COMPONENTS}")
        key = (layer, comp)
        if key not in widths:
            widths[key] = component_width(model, layer, comp)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < widths[key]:
            raise ValueError(f"neurons: index {index!r} of layer {layer} {comp} is not in [0, {widths[key]})")
        out.append((layer, comp, index))
    return sorted(set(out))


def component_width(model, layer: int, comp: str) -> int:
    """The number of neurons of `comp` in encoder layer `layer` (1-indexed) of `model` (the width of the Linear that
    produces them, from the family's table entry)."""
    return families.component_width(models.structure(model).layer_modules[layer - 1], comp)


def _scaler(index: torch.Tensor, factor: float, rest: float = 1.0):
    def fn(x):
        x = x.clone()
        idx = index.to(x.device)
        chosen = x[:, 0, idx] * factor
        if rest != 1.0:  # inverted-dropout rescale of the component's other first-token activations
            x[:, 0] = x[:, 0] * rest
        x[:, 0, idx] = chosen
        return x

    return fn


def mask_neurons(model, neurons: Iterable[Sequence], factor: float = 0.0, rescale: bool = False):
    """Multiply the first-token activation of each of `neurons` ((layer, component, index), 1-indexed layers) by
    `factor` in every later forward of `model` (0: the paper's hard mask; 0 < factor < 1 weakens). ``rescale=True``
    (the paper's inverted-dropout form) also multiplies the component's OTHER first-token activations by 1/p, p the
    fraction of its width left unmasked. Replaces a mask set before. Returns `model`."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
        raise ValueError(f"factor: expected a finite number, got {factor!r}")
    if not isinstance(rescale, bool):
        raise ValueError(f"rescale: expected a bool, got {rescale!r}")
    chosen = normalise_neurons(model, neurons)
    unmask_neurons(model)
    blocks = []
    by_key = {}
    for layer, comp, index in chosen:
        by_key.setdefault((layer, comp), []).append(index)
    for (layer, comp), idx in by_key.items():
        width = component_width(model, layer, comp)
        if rescale and len(idx) == width:
            raise ValueError(f"rescale: every neuron of layer {layer} {comp} is masked (p = 0)")
        rest = width / (width - len(idx)) if rescale else 1.0
        block = models.intervene(model, layer, comp, _scaler(torch.tensor(idx), float(factor), rest))
        block.__enter__()
        blocks.append(block)
    setattr(model, _ATTR, blocks)
    setattr(model.config, CONFIG_KEY, {"factor": float(factor), "neurons": [list(n) for n in chosen],
                                       "positions": "first token", "rescale": rescale})
    return model


def unmask_neurons(model):
    """Remove the mask `mask_neurons` set (no-op if none). Returns `model`."""
    for block in reversed(getattr(model, _ATTR, [])):
        block.__exit__(None, None, None)
    if hasattr(model, _ATTR):
        delattr(model, _ATTR)
    if hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)
    return model


def masked_neurons(model):
    """The mask recorded on `model` ({"factor", "neurons"}), or None."""
    return getattr(model.config, CONFIG_KEY, None)


def apply_saved_mask(model):
    """Re-apply the mask recorded in ``model.config`` (a model loaded with ``from_pretrained``). Returns `model`."""
    spec = masked_neurons(model)
    if spec is None:
        return model
    if not isinstance(spec, dict) or "neurons" not in spec or "factor" not in spec:
        raise ValueError(f"config.{CONFIG_KEY}: expected {{'factor': f, 'neurons': [[layer, component, index], ...]}}, "
                         f"got {spec!r}")
    return mask_neurons(model, [tuple(n) for n in spec["neurons"]], spec["factor"], bool(spec.get("rescale", False)))


def load_masked(model_dir: str, **kwargs):
    """``(model, tokenizer)`` from a directory a masked model was saved to, with its mask applied: what
    `cat_fast.models.pretrained.load_classifier` (its arguments in `kwargs`) does by default."""
    from ..models.pretrained import load_classifier

    return load_classifier(model_dir, **kwargs)


README = "README.md"

_README = """# A classifier with a neuron mask (cat_fast)

This directory holds a text classifier with {n} neurons masked at the first token ({where}): their activation is
multiplied by {factor}{rescaled}. The mask is applied while the model runs: the weights in this directory are the
unmasked model's, and the mask is recorded in config.json under `{key}`.

## Load it masked

```python
from cat_fast.analysis.masking import load_masked

model, tokenizer = load_masked("path/to/this/directory")
```

Every `cat-fast` command (`cat-fast eval --model DIR`, ...) applies the mask too.

## Without cat_fast it runs UNMASKED

`AutoModelForSequenceClassification.from_pretrained(DIR)` and `transformers.pipeline("text-classification",
model=DIR)` load the weights without the mask and say nothing: their predictions are the unmasked model's. To mask
a model loaded that way:

```python
from cat_fast.analysis.masking import apply_saved_mask

model = apply_saved_mask(model)  # the mask recorded in config.json's {key}
```
"""


def write_readme(directory: str, model) -> bool:
    """Write ``README.md`` into `directory` (where a masked `model` was saved): the mask, and how to load the model
    masked (`load_masked`), since ``from_pretrained`` and ``pipeline`` load it unmasked. Returns whether `model` is
    masked (nothing is written for an unmasked one)."""
    import os

    spec = masked_neurons(model)
    if spec is None:
        return False
    neurons = [tuple(n) for n in spec.get("neurons", ())]
    counts = {}
    for layer, comp, _ in neurons:
        counts[(layer, comp)] = counts.get((layer, comp), 0) + 1
    where = "; ".join(f"layer {layer} {comp}: {k}" for (layer, comp), k in sorted(counts.items())) or "none"
    rescaled = (", the component's other first-token activations rescaled by 1/p (p: the fraction left unmasked)"
                if spec.get("rescale") else "")
    text = _README.format(n=len(neurons), factor=spec.get("factor"), rescaled=rescaled, where=where, key=CONFIG_KEY)
    with open(os.path.join(directory, README), "w", encoding="utf-8") as f:
        f.write(text)
    return True
