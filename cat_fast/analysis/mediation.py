"""Causal mediation analysis of neurons (docs/METHODS.md §3): the natural indirect effect of every neuron on the
probability of a target class, with many interventions per forward.

    from cat_fast.analysis import mediation
    zbar = mediation.treatment_means(model, treatment)                # mean first-token activation per neuron
    nie = mediation.neuron_effects(model, samples, zbar, target_class="entailment")
    nie.top(20)                                                        # [(layer, component, neuron, NIE), ...]

`samples` and `treatment` are tokenised batches (dicts of [N, T] tensors with ``attention_mask``). A neuron is one
unit of a layer's component (`cat_fast.models.COMPONENTS`: query, key, value, attention_output, intermediate,
output) at the FIRST token. ``NIE(n) = mean_u p_t(u | do(z_n(u, 0) = z̄_n)) / p_t(u) − 1``.

`neuron_effects` is exact: for a layer ℓ it runs the layers below once per batch (`models.capture`), then resumes
layers ℓ..L on K copies of the batch stacked along the batch dimension, copy k with neuron k replaced
(`models.resume(..., repeat=K)` with an intervention on ℓ's component), the last layer for the first token only;
samples are grouped by length so that little is padding. `neuron_effects_looped` is the paper's method (one whole
hooked forward per neuron), kept as the reference. `attribution_effects` is the first-order estimate from one
forward and one backward per batch: ``mean_u ∂ log p_t(u) / ∂z_n(u, 0) · (z̄_n − z_n(u, 0))``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .. import models

__all__ = ["NeuronEffects", "treatment_means", "neuron_effects", "neuron_effects_looped", "attribution_effects",
           "length_batches"]

Key = Tuple[int, str]  # (layer 1..L, component)


@dataclass
class NeuronEffects:
    """Per (layer, component): a float32 tensor [width] of effects (NIE), on the CPU."""

    effects: Dict[Key, torch.Tensor] = field(default_factory=dict)
    target_class: int = 0
    n_samples: int = 0

    def flat(self) -> Tuple[torch.Tensor, List[Tuple[int, str, int]]]:
        """All effects as one vector and the (layer, component, neuron) of each entry."""
        values, names = [], []
        for (layer, comp), v in sorted(self.effects.items(), key=lambda kv: (kv[0][0], _rank(kv[0][1]))):
            values.append(v)
            names.extend((layer, comp, i) for i in range(v.numel()))
        return (torch.cat(values) if values else torch.empty(0)), names

    def top(self, k: int, by: str = "value") -> List[Tuple[int, str, int, float]]:
        """The k neurons with the largest effect (``by="abs"``: largest |effect|)."""
        values, names = self.flat()
        score = values.abs() if by == "abs" else values
        k = min(int(k), values.numel())
        idx = torch.topk(score, k).indices.tolist()
        return [(*names[i], float(values[i])) for i in idx]

    def random(self, k: int, seed: int = 0) -> List[Tuple[int, str, int, float]]:
        """k neurons drawn uniformly without replacement (a seeded CPU generator): the paper's "without CMA"
        control, in the format of `top`."""
        values, names = self.flat()
        k = min(int(k), values.numel())
        idx = torch.randperm(values.numel(), generator=torch.Generator().manual_seed(int(seed)))[:k].tolist()
        return [(*names[i], float(values[i])) for i in idx]

    def counts(self, k: int) -> Dict[Key, int]:
        """How many of the top-k neurons sit in each (layer, component): the paper's figure."""
        out: Dict[Key, int] = {}
        for layer, comp, _, _ in self.top(k):
            out[(layer, comp)] = out.get((layer, comp), 0) + 1
        return out


def _rank(comp):
    return models.COMPONENTS.index(comp) if comp in models.COMPONENTS else len(models.COMPONENTS)


def _check(model, components, layers):
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


def _from_zbar(model, zbar, components, layers):
    """The components and layers to sweep: those given, else those `zbar` has means for."""
    if not isinstance(zbar, dict) or not zbar:
        raise ValueError("zbar: expected the treatment means {(layer, component): [width]} of treatment_means")
    keys = sorted(zbar, key=lambda kv: (kv[0], _rank(kv[1])))
    if components is None:
        components = tuple(dict.fromkeys(c for _, c in keys))
    if layers is None:
        layers = tuple(dict.fromkeys(layer for layer, _ in keys))
    return _check(model, components, layers)


def _target(model, target_class):
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


def _check_samples(name, samples):
    if not isinstance(samples, dict) or "input_ids" not in samples or "attention_mask" not in samples:
        raise ValueError(f"{name}: expected a tokenised batch, a dict with 'input_ids' and 'attention_mask' [N, T]")
    n = samples["input_ids"].shape[0]
    if n == 0:
        raise ValueError(f"{name}: expected at least one sample")
    for k, v in samples.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] != n:
            raise ValueError(f"{name}[{k!r}]: expected {n} rows like input_ids, got {tuple(v.shape)}")
    return n


def length_batches(samples: dict, max_tokens: int, max_rows: Optional[int] = None) -> Iterable[dict]:
    """`samples` cut into batches of similar length (sorted by length, each batch trimmed to its longest sample,
    at most `max_tokens` padded tokens). Keys other than model inputs are dropped."""
    mask = samples["attention_mask"]
    lengths = mask.sum(-1)
    order = torch.argsort(lengths, descending=True, stable=True)
    keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in samples]
    start, n = 0, order.numel()
    while start < n:
        longest = max(1, int(lengths[order[start]]))
        rows = max(1, max_tokens // longest)
        if max_rows:
            rows = min(rows, max_rows)
        idx = order[start:start + rows]
        yield {k: samples[k][idx][:, :longest] for k in keys}
        start += rows


def _to(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


def _first_token_recorder(store, key):
    def fn(x):
        store[key] = x[:, 0]
        return x

    return fn


@torch.no_grad()
def treatment_means(model, treatment: dict, components=models.COMPONENTS, layers=None, max_tokens: int = 16384
                    ) -> Dict[Key, torch.Tensor]:
    """z̄: the mean first-token activation of every neuron over the treatment samples (summed in float64; float32,
    or float64 for a float64 model) on the model's device, {(layer, component): [width]}."""
    components, layers = _check(model, components, layers)
    _check_samples("treatment", treatment)
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    sums: Dict[Key, torch.Tensor] = {}
    dtypes: Dict[Key, torch.dtype] = {}
    count = 0
    try:
        for batch in length_batches(treatment, max_tokens):
            batch = _to(batch, device)
            store: Dict[Key, torch.Tensor] = {}
            with _interventions(model, [((layer, c), _first_token_recorder(store, (layer, c)))
                                        for layer in layers for c in components]):
                model(**batch)
            for key, v in store.items():
                s = v.double().sum(0)
                sums[key] = s if key not in sums else sums[key] + s
                dtypes[key] = torch.float64 if v.dtype == torch.float64 else torch.float32
            count += batch["input_ids"].shape[0]
    finally:
        model.train(was)
    return {k: (v / count).to(dtypes[k]) for k, v in sums.items()}


class _interventions:
    """Several `models.intervene` blocks at once: [((layer, component), fn), ...]."""

    def __init__(self, model, items):
        self.model, self.items, self.stack = model, items, []

    def __enter__(self):
        for (layer, comp), fn in self.items:
            cm = models.intervene(self.model, layer, comp, fn)
            cm.__enter__()
            self.stack.append(cm)
        return self

    def __exit__(self, *exc):
        while self.stack:
            self.stack.pop().__exit__(*exc)
        return False


def _probs(model, batch, target):
    logits = models.logits_of(model(**batch))
    return torch.softmax(logits.double(), -1)[:, target]


def _setter(neurons: torch.Tensor, values: torch.Tensor, copies: int):
    """fn for a stacked pass: copy k (rows k·B..) gets neuron neurons[k] at token 0 set to values[k]."""

    def fn(x):
        kb, t, w = x.shape
        b = kb // copies
        x = x.clone()
        view = x.view(copies, b, t, w)
        rows = torch.arange(copies, device=x.device)
        view[rows, :, 0, neurons] = values.to(x.dtype)[:, None]
        return x

    return fn


@torch.no_grad()
def neuron_effects(model, samples: dict, zbar: Dict[Key, torch.Tensor], target_class=0, components=None,
                   layers=None, max_tokens: int = 65536, batch_tokens: int = 16384, progress: bool = False
                   ) -> NeuronEffects:
    """The exact NIE of every neuron of `components` (default: those of `zbar`) in `layers` (module docstring).

    `max_tokens`: padded tokens per stacked pass (copies × batch × length); `batch_tokens`: per batch of samples.
    Runs under the caller's autocast, if any; probabilities and their ratios are taken in float64."""
    components, layers = _from_zbar(model, zbar, components, layers)
    target = _target(model, target_class)
    n = _check_samples("samples", samples)
    keys = [(layer, c) for layer in layers for c in components]
    for key in keys:
        if key not in zbar:
            raise ValueError(f"zbar: no treatment means for layer {key[0]} {key[1]} (treatment_means with these "
                             "layers and components)")
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    sums = {key: torch.zeros(zbar[key].numel(), dtype=torch.float64, device=device) for key in keys}
    total = sum(v.numel() for v in sums.values())
    bar = _progress(progress, total * math.ceil(n), "mediation")
    prune = True
    try:
        for batch in length_batches(samples, batch_tokens):
            batch = _to(batch, device)
            b, t = batch["input_ids"].shape
            base = _probs(model, batch, target)  # [b]
            prune = models.first_token_ready(model, batch)
            copies = max(1, max_tokens // (b * t))
            for layer in layers:
                cap = models.capture(model, batch, layer - 1, rng=False)
                h = cap.hidden
                for comp in components:
                    z = zbar[(layer, comp)].to(device)
                    width = z.numel()
                    for start in range(0, width, copies):
                        idx = torch.arange(start, min(start + copies, width), device=device)
                        k = idx.numel()
                        h_k = h.repeat(k, *([1] * (h.dim() - 1)))
                        with models.intervene(model, layer, comp, _setter(idx, z[idx], k)):
                            out = models.resume(model, cap, h_k, first_token=prune, repeat=k)
                        p = torch.softmax(models.logits_of(out).double(), -1)[:, target].view(k, b)
                        sums[(layer, comp)][idx] += (p / base).sum(1)
                        bar.update(k * b)
    finally:
        bar.close()
        model.train(was)
    return NeuronEffects({key: (v / n - 1).float().cpu() for key, v in sums.items()}, target, n)


@torch.no_grad()
def neuron_effects_looped(model, samples: dict, zbar: Dict[Key, torch.Tensor], target_class=0, components=None,
                          layers=None, batch_size: int = 128, neurons: Optional[Dict[Key, Sequence[int]]] = None
                          ) -> NeuronEffects:
    """The paper's method and the reference of `neuron_effects`: one whole forward of each batch (of `batch_size`
    samples padded to their longest) per neuron, with one intervention hook. `neurons` limits the sweep to some
    neurons per (layer, component) (the others are NaN): for timing a subset."""
    components, layers = _from_zbar(model, zbar, components, layers)
    target = _target(model, target_class)
    n = _check_samples("samples", samples)
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    keep = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in samples]
    batches = []
    for start in range(0, n, batch_size):
        batch = {k: samples[k][start:start + batch_size] for k in keep}
        longest = int(batch["attention_mask"].sum(-1).max())
        batches.append(_to({k: v[:, :longest] for k, v in batch.items()}, device))
    out = {}
    try:
        bases = [_probs(model, batch, target) for batch in batches]
        for layer in layers:
            for comp in components:
                z = zbar[(layer, comp)].to(device)
                chosen = range(z.numel()) if neurons is None else neurons.get((layer, comp), ())
                effects = torch.full((z.numel(),), float("nan"), dtype=torch.float64)
                for i in chosen:
                    acc = 0.0
                    for batch, base in zip(batches, bases):
                        def fn(x, i=i):
                            x = x.clone()
                            x[:, 0, i] = z[i].to(x.dtype)
                            return x

                        with models.intervene(model, layer, comp, fn):
                            p = _probs(model, batch, target)
                        acc = acc + (p / base).sum()
                    effects[i] = float(acc) / n - 1
                out[(layer, comp)] = effects.float()
    finally:
        model.train(was)
    return NeuronEffects(out, target, n)


def attribution_effects(model, samples: dict, zbar: Dict[Key, torch.Tensor], target_class=0, components=None,
                        layers=None, batch_tokens: int = 16384) -> NeuronEffects:
    """First-order NIE (attribution patching): ``mean_u ∂ log p_t(u)/∂z_n(u, 0) · (z̄_n − z_n(u, 0))`` from one
    forward and one backward per batch of samples."""
    components, layers = _from_zbar(model, zbar, components, layers)
    target = _target(model, target_class)
    n = _check_samples("samples", samples)
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    keys = [(layer, c) for layer in layers for c in components]
    sums = {key: torch.zeros(zbar[key].numel(), dtype=torch.float64, device=device) for key in keys}
    try:
        for batch in length_batches(samples, batch_tokens):
            batch = _to(batch, device)
            store: Dict[Key, torch.Tensor] = {}

            def recorder(key):
                def fn(x):
                    if not x.requires_grad:  # nothing upstream needs a gradient (frozen weights): start the graph here
                        x = x.detach().requires_grad_()
                    store[key] = x
                    return x

                return fn

            with torch.enable_grad(), _interventions(model, [(key, recorder(key)) for key in keys]):
                logits = models.logits_of(model(**batch))
                score = torch.log_softmax(logits.double(), -1)[:, target].sum()
                acts = [store[key] for key in keys]
                grads = torch.autograd.grad(score, acts, allow_unused=True)
            for key, x, g in zip(keys, acts, grads):
                if g is None:
                    continue
                delta = zbar[key].to(device).double() - x[:, 0].detach().double()
                sums[key] += (g[:, 0].double() * delta).sum(0)
    finally:
        model.train(was)
    return NeuronEffects({key: (v / n).float().cpu() for key, v in sums.items()}, target, n)


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(enabled, total, desc):
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="neuron·sample", mininterval=1.0)
