"""Causal mediation analysis of neurons (docs/METHODS.md §3): the natural indirect effect of every neuron on the
probability of a target class, with many interventions per forward.

    from cat_fast.analysis import mediation
    zbar = mediation.treatment_means(model, treatment)                # mean first-token activation per neuron
    nie = mediation.neuron_effects(model, samples, zbar, target_class="entailment")
    nie.top(20)                                                        # [(layer, component, neuron, NIE), ...]

`samples` and `treatment` are tokenised batches (dicts of [N, T] tensors with ``attention_mask``). A neuron is one
unit of a layer's component (`cat_fast.models.COMPONENTS`: query, key, value, attention_output, intermediate,
output) at the FIRST token. ``NIE(n) = mean_u p_t(u | do(z_n(u, 0) = z̄_n)) / p_t(u) − 1``.

`neuron_effects` is exact: samples are grouped by length so that little is padding, and each neuron's edit runs on
one of K copies of a batch stacked along the batch dimension (copy k with neuron k replaced). For the layer families
of the per-family table (`models.families.layer_pieces`) one clean forward per (batch, layer ℓ) records layers ℓ and
ℓ + 1 (inputs, masks, components) and the copies compute only what the edit changes (`mediation_rows`): an edit of
ℓ's query, attention output, intermediate or output changes row 0 of ℓ's output only, so layer ℓ runs for row 0
(nothing for an output neuron) and layer ℓ + 1 reuses the clean projections of rows ≥ 1; an edit of a key or value
changes every row's attention, so layer ℓ reruns attention and the rest for every row without the projections. The
layers' own modules compute the pieces (autocast, activation, eps and scaling are the model's); layers ℓ + 2..L
resume the model (`models.resume(..., repeat=K)`), the last layer for the first token only where the head reads
nothing else, and the model's head gives the logits. Elsewhere (other layouts, hooks on a layer's parts,
interventions in effect) and with ``fast=False`` every copy resumes layers ℓ..L whole with an intervention on ℓ's
component. `sweep_flops` counts the matmuls of both (`mediation_flops`).
`neuron_effects_looped` is the paper's method (one whole hooked forward per neuron), kept as the reference.
`attribution_effects` is the first-order estimate from one forward and one backward per batch:
``mean_u ∂ log p_t(u) / ∂z_n(u, 0) · (z̄_n − z_n(u, 0))``.

The effects container is `mediation_effects.NeuronEffects`, the sample handling `mediation_samples`; their public
names are importable from here.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import torch

from .. import models
from ..models import families
from .mediation_effects import Key, NeuronEffects
from .mediation_flops import sweep_flops
from .mediation_rows import Interventions as _interventions
from .mediation_rows import fast_logits as _fast_logits
from .mediation_rows import record as _record
from .mediation_samples import INPUTS, check, check_samples, from_zbar, length_batches, target, to_device

__all__ = ["NeuronEffects", "treatment_means", "neuron_effects", "neuron_effects_looped", "attribution_effects",
           "length_batches", "sweep_flops", "split_keys"]

_fast_ops = families.layer_pieces  # every layer in row-wise pieces, or None where the fast path does not apply


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
    components, layers = check(model, components, layers)
    treatment, _ = check_samples("treatment", treatment)
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    sums: Dict[Key, torch.Tensor] = {}
    dtypes: Dict[Key, torch.dtype] = {}
    count = 0
    try:
        for batch in length_batches(treatment, max_tokens):
            batch = to_device(batch, device)
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
                   layers=None, max_tokens: int = 65536, batch_tokens: int = 16384, progress: bool = False,
                   fast: bool = True, distributed: bool = False) -> NeuronEffects:
    """The exact NIE of every neuron of `components` (default: those of `zbar`) in `layers` (module docstring).

    `max_tokens`: padded tokens per stacked pass (copies × batch × length); `batch_tokens`: per batch of samples.
    Runs under the caller's autocast, if any; probabilities and their ratios are taken in float64. ``fast=False``:
    the stacked path for every layer (each copy recomputes layers ℓ..L whole), which the fast path falls back to
    where it does not apply; for comparisons. ``distributed=True`` (every rank of the initialised default process
    group calls it with the same arguments, its model on its own device): the (layer, component) tables are split
    over the ranks by their cost (`split_keys`), each rank sweeps its own, and every rank returns all of them
    (`all_gather_object`); each table is computed by one rank exactly as one process would."""
    components, layers = from_zbar(model, zbar, components, layers)
    label = target(model, target_class)
    samples, n = check_samples("samples", samples)
    keys = [(layer, c) for layer in layers for c in components]
    for key in keys:
        if key not in zbar:
            raise ValueError(f"zbar: no treatment means for layer {key[0]} {key[1]} (treatment_means with these "
                             "layers and components)")
    if distributed:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("distributed=True: no default process group (torch.distributed.init_process_group, or "
                             "run under torchrun)")
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = split_keys(model, keys, {key: zbar[key].numel() for key in keys}, world)[rank]
        local = _neuron_effects(model, samples, zbar, label, n, mine, sorted({k[0] for k in mine}), components,
                                max_tokens, batch_tokens, progress and rank == 0, fast) if mine else \
            NeuronEffects({}, label, n)
        gathered = [None] * world
        dist.all_gather_object(gathered, {key: v for key, v in local.effects.items()})
        effects = {}
        for part in gathered:
            effects.update(part)
        return NeuronEffects({key: effects[key] for key in keys}, label, n)
    return _neuron_effects(model, samples, zbar, label, n, keys, layers, components, max_tokens, batch_tokens,
                           progress, fast)


def split_keys(model, keys, widths, world: int):
    """The (layer, component) tables `keys` split over `world` ranks: largest cost first, each to the rank with the
    least so far (ties: the lowest rank), the cost of a table its width times the layers above it plus one (what the
    sweep recomputes per neuron). Deterministic: every rank computes the same split."""
    L = models.structure(model).num_layers
    loads, parts = [0] * world, [[] for _ in range(world)]
    for key in sorted(keys, key=lambda k: (-widths[k] * (L - k[0] + 1), k[0], k[1])):
        r = min(range(world), key=lambda i: (loads[i], i))
        parts[r].append(key)
        loads[r] += widths[key] * (L - key[0] + 1)
    return parts


def _neuron_effects(model, samples, zbar, target, n, keys, layers, components, max_tokens, batch_tokens, progress,
                    fast):
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    sums = {key: torch.zeros(zbar[key].numel(), dtype=torch.float64, device=device) for key in keys}
    total = sum(v.numel() for v in sums.values())
    bar = _progress(progress, total * math.ceil(n), "mediation")
    try:
        ops = _fast_ops(model) if fast else None
        for batch in length_batches(samples, batch_tokens):
            batch = to_device(batch, device)
            b, t = batch["input_ids"].shape
            base = _probs(model, batch, target)  # [b]
            prune = models.first_token_ready(model, batch)
            copies = max(1, max_tokens // (b * t))
            for layer in layers:
                clean = _record(model, batch, layer) if ops is not None else None
                cap = None if clean is not None else models.capture(model, batch, layer - 1, rng=False)
                for comp in components:
                    if (layer, comp) not in sums:
                        continue
                    z = zbar[(layer, comp)].to(device)
                    width = z.numel()
                    for start in range(0, width, copies):
                        idx = torch.arange(start, min(start + copies, width), device=device)
                        k = idx.numel()
                        if clean is not None:
                            logits = _fast_logits(model, ops, clean, comp, idx, z[idx], prune)
                        else:
                            h_k = cap.hidden.repeat(k, *([1] * (cap.hidden.dim() - 1)))
                            with models.intervene(model, layer, comp, _setter(idx, z[idx], k)):
                                out = models.resume(model, cap, h_k, first_token=prune, repeat=k)
                            logits = models.logits_of(out)
                        p = torch.softmax(logits.double(), -1)[:, target].view(k, b)
                        sums[(layer, comp)][idx] += (p / base).sum(1)
                        bar.update(k * b)
                del clean, cap
    finally:
        bar.close()
        model.train(was)
    return NeuronEffects({key: (v / n - 1).float().cpu() for key, v in sums.items()}, target, n)


@torch.no_grad()
def _sweep_setup(model, zbar, samples, target_class, components, layers):
    """The checked arguments of a sweep over neurons (components, layers, target label, samples and their count),
    the model's device and training flag; the model is put in eval mode (the caller restores the flag)."""
    components, layers = from_zbar(model, zbar, components, layers)
    label = target(model, target_class)
    samples, n = check_samples("samples", samples)
    was = model.training
    model.eval()
    return components, layers, label, samples, n, next(model.parameters()).device, was


def neuron_effects_looped(model, samples: dict, zbar: Dict[Key, torch.Tensor], target_class=0, components=None,
                          layers=None, batch_size: int = 128, neurons: Optional[Dict[Key, Sequence[int]]] = None
                          ) -> NeuronEffects:
    """The paper's method and the reference of `neuron_effects`: one whole forward of each batch (of `batch_size`
    samples padded to their longest) per neuron, with one intervention hook. `neurons` limits the sweep to some
    neurons per (layer, component) (the others are NaN): for timing a subset."""
    components, layers, label, samples, n, device, was = _sweep_setup(model, zbar, samples, target_class, components,
                                                                      layers)
    keep = [k for k in INPUTS if k in samples]
    batches = []
    for start in range(0, n, batch_size):
        batch = {k: samples[k][start:start + batch_size] for k in keep}
        longest = int(batch["attention_mask"].sum(-1).max())
        batches.append(to_device({k: v[:, :longest] for k, v in batch.items()}, device))
    out = {}
    try:
        bases = [_probs(model, batch, label) for batch in batches]
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
                            p = _probs(model, batch, label)
                        acc = acc + (p / base).sum()
                    effects[i] = float(acc) / n - 1
                out[(layer, comp)] = effects.float()
    finally:
        model.train(was)
    return NeuronEffects(out, label, n)


def _grad_recorder(store, key):
    def fn(x):
        if not x.requires_grad:  # nothing upstream needs a gradient (frozen weights): start the graph here
            x = x.detach().requires_grad_()
        store[key] = x
        return x

    return fn


def attribution_effects(model, samples: dict, zbar: Dict[Key, torch.Tensor], target_class=0, components=None,
                        layers=None, batch_tokens: int = 16384) -> NeuronEffects:
    """First-order NIE (attribution patching): ``mean_u ∂ log p_t(u)/∂z_n(u, 0) · (z̄_n − z_n(u, 0))`` from one
    forward and one backward per batch of samples."""
    components, layers, label, samples, n, device, was = _sweep_setup(model, zbar, samples, target_class, components,
                                                                      layers)
    keys = [(layer, c) for layer in layers for c in components]
    sums = {key: torch.zeros(zbar[key].numel(), dtype=torch.float64, device=device) for key in keys}
    try:
        for batch in length_batches(samples, batch_tokens):
            batch = to_device(batch, device)
            store: Dict[Key, torch.Tensor] = {}
            with torch.enable_grad(), _interventions(model, [(key, _grad_recorder(store, key)) for key in keys]):
                logits = models.logits_of(model(**batch))
                score = torch.log_softmax(logits.double(), -1)[:, label].sum()
                acts = [store[key] for key in keys]
                grads = torch.autograd.grad(score, acts, allow_unused=True)
            for key, x, g in zip(keys, acts, grads):
                if g is None:
                    continue
                delta = zbar[key].to(device).double() - x[:, 0].detach().double()
                sums[key] += (g[:, 0].double() * delta).sum(0)
    finally:
        model.train(was)
    return NeuronEffects({key: (v / n).float().cpu() for key, v in sums.items()}, label, n)


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
