"""The inputs of a mediation sweep (`mediation`): the samples as one tokenised batch cut into length batches, the
target class, and the layers and components checked against the model."""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

import torch
import torch.nn.functional as F

from .. import models
from .mediation_effects import rank

__all__ = ["INPUTS", "check", "from_zbar", "target", "check_samples", "length_batches", "to_device"]

INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # the model inputs a sweep keeps


def check(model, components, layers):
    """(components, layers) checked against `model` (a sequence classifier); ``layers=None``: every layer."""
    st = models.structure(model)
    if st.task != "sequence_classification":
        raise ValueError(f"mediation: expected a *ForSequenceClassification model, got {st.model_class}")
    components = tuple(components)
    for c in components:
        if c not in models.COMPONENTS:
            raise ValueError(f"components: expected names from {models.COMPONENTS}, got {c!r}")
    L = st.num_layers
    layers = tuple(range(1, L + 1)) if layers is None else tuple(layers)
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer <= L:
            raise ValueError(f"layers: expected integers in [1, {L}], got {layer!r}")
    return components, layers


def from_zbar(model, zbar, components, layers):
    """The components and layers to sweep: those given, else those `zbar` has means for."""
    if not isinstance(zbar, dict) or not zbar:
        raise ValueError("zbar: expected the treatment means {(layer, component): [width]} of treatment_means")
    keys = sorted(zbar, key=lambda kv: (kv[0], rank(kv[1])))
    if components is None:
        components = tuple(dict.fromkeys(c for _, c in keys))
    if layers is None:
        layers = tuple(dict.fromkeys(layer for layer, _ in keys))
    return check(model, components, layers)


def target(model, target_class) -> int:
    """The class index of `target_class` (a label name of ``config.label2id`` or an index)."""
    if isinstance(target_class, str):
        label2id = {str(k).lower(): int(v) for k, v in (getattr(model.config, "label2id", None) or {}).items()}
        if target_class.lower() not in label2id:
            raise ValueError(f"target_class: {target_class!r} is not a label of the model (config.label2id: "
                             f"{sorted(label2id)})")
        return label2id[target_class.lower()]
    n = model.config.num_labels
    if isinstance(target_class, bool) or not isinstance(target_class, int) or not 0 <= target_class < n:
        raise ValueError(f"target_class: expected a label name or an index in [0, {n}), got {target_class!r}")
    return target_class


def _joined(batches):
    """Tokenised batches as one: 2-D tensors right-padded with 0 (masked out) to the longest, then concatenated."""
    longest = max(b["input_ids"].shape[1] for b in batches)
    out = {}
    for k in batches[0]:
        parts = [torch.as_tensor(b[k]) for b in batches]
        if parts[0].dim() == 2:
            parts = [F.pad(p, (0, longest - p.shape[1])) for p in parts]
        out[k] = torch.cat(parts)
    return out


def check_samples(name, samples):
    """(samples as one dict, N): a tokenised batch (a dict or a tokenizer's BatchEncoding) or a list of them."""
    if isinstance(samples, (list, tuple)) and samples and all(isinstance(b, Mapping) for b in samples):
        if all("input_ids" in b and "attention_mask" in b for b in samples):
            samples = _joined(samples)
    if isinstance(samples, Mapping):
        samples = dict(samples)
    if not isinstance(samples, dict) or "input_ids" not in samples or "attention_mask" not in samples:
        raise ValueError(f"{name}: expected a tokenised batch (a dict or BatchEncoding with 'input_ids' and "
                         "'attention_mask' [N, T]) or a list of them")
    n = samples["input_ids"].shape[0]
    if n == 0:
        raise ValueError(f"{name}: expected at least one sample")
    for k, v in samples.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] != n:
            raise ValueError(f"{name}[{k!r}]: expected {n} rows like input_ids, got {tuple(v.shape)}")
    return samples, n


def length_batches(samples: dict, max_tokens: int, max_rows: Optional[int] = None) -> Iterable[dict]:
    """`samples` cut into batches of similar length (sorted by length, each batch trimmed to its longest sample,
    at most `max_tokens` padded tokens). Keys other than model inputs are dropped."""
    mask = samples["attention_mask"]
    lengths = mask.sum(-1)
    order = torch.argsort(lengths, descending=True, stable=True)
    keys = [k for k in INPUTS if k in samples]
    start, n = 0, order.numel()
    while start < n:
        longest = max(1, int(lengths[order[start]]))
        rows = max(1, max_tokens // longest)
        if max_rows:
            rows = min(rows, max_rows)
        idx = order[start:start + rows]
        yield {k: samples[k][idx][:, :longest] for k in keys}
        start += rows


def to_device(batch, device):
    return {k: v.to(device) for k, v in batch.items()}
