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
one of K copies of a batch stacked along the batch dimension (copy k with neuron k replaced). For the Bert and
DistilBERT layouts (`_fast_ops`) one clean forward per (batch, layer ℓ) records layers ℓ and ℓ + 1 (inputs, masks,
components) and the copies compute only what the edit changes: an edit of ℓ's query, attention output, intermediate
or output changes row 0 of ℓ's output only, so layer ℓ runs for row 0 (nothing for an output neuron) and layer ℓ + 1
reuses the clean projections of rows ≥ 1; an edit of a key or value changes every row's attention, so layer ℓ reruns
attention and the rest for every row without the projections. The layers' own modules compute the pieces (autocast,
activation, eps and scaling are the model's); layers ℓ + 2..L resume the model (`models.resume(..., repeat=K)`), the
last layer for the first token only where the head reads nothing else, and the model's head gives the logits.
Elsewhere (other layouts, hooks on a layer's parts, interventions in effect) and with ``fast=False`` every copy
resumes layers ℓ..L whole with an intervention on ℓ's component. `sweep_flops` counts the matmuls of both.
`neuron_effects_looped` is the paper's method (one whole hooked forward per neuron), kept as the reference.
`attribution_effects` is the first-order estimate from one forward and one backward per batch:
``mean_u ∂ log p_t(u) / ∂z_n(u, 0) · (z̄_n − z_n(u, 0))``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .. import models
from ..layers import first_token, interventions, layout

__all__ = ["NeuronEffects", "treatment_means", "neuron_effects", "neuron_effects_looped", "attribution_effects",
           "length_batches", "sweep_flops", "split_keys"]

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


def _check_samples(name, samples):
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
    treatment, _ = _check_samples("treatment", treatment)
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
    components, layers = _from_zbar(model, zbar, components, layers)
    target = _target(model, target_class)
    samples, n = _check_samples("samples", samples)
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
        local = _neuron_effects(model, samples, zbar, target, n, mine, sorted({k[0] for k in mine}), components,
                                max_tokens, batch_tokens, progress and rank == 0, fast) if mine else \
            NeuronEffects({}, target, n)
        gathered = [None] * world
        dist.all_gather_object(gathered, {key: v for key, v in local.effects.items()})
        effects = {}
        for part in gathered:
            effects.update(part)
        return NeuronEffects({key: effects[key] for key in keys}, target, n)
    return _neuron_effects(model, samples, zbar, target, n, keys, layers, components, max_tokens, batch_tokens,
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
            batch = _to(batch, device)
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


# ----------------------------------------------------------------------------- the fast path of neuron_effects
# An edit at token 0 of layer ℓ's query, attention output, intermediate or output changes row 0 of layer ℓ's output
# only ("row-0 form": the clean rows plus one edited row 0 per copy, [K, b, D]); an edit of its key or value changes
# every row ("full form": [K·b, t, D]). The clean activations of layers ℓ and ℓ+1 come from one recorded forward per
# (batch, layer); copies compute only what the edit changes, with the layer's own modules (so autocast, the
# activation, LayerNorm eps and the attention scaling are the model's); layers ℓ+2.. and the head run the model via
# `models.resume`. `sweep_flops` counts the matmuls.


class _Ops:
    """One encoder layer of the Bert or DistilBERT layout, called in pieces on chosen rows with its own modules."""

    def __init__(self, layer):
        if layout.family(layer) == "bert":
            sa = layer.attention.self
            self.query, self.key, self.value = sa.query, sa.key, sa.value
            self.heads = sa.num_attention_heads
            self.attended = layer.attention.output  # (context, residual) -> attention_output
            self.intermediate = layer.intermediate  # attention_output -> intermediate
            self.output = layer.output  # (intermediate, attention_output) -> output
        else:  # distilbert
            sa, ffn = layer.attention, layer.ffn
            self.query, self.key, self.value = sa.q_lin, sa.k_lin, sa.v_lin
            self.heads = sa.n_heads
            self.attended = lambda context, x: layer.sa_layer_norm(sa.out_lin(context) + x)
            self.intermediate = lambda a: ffn.activation(ffn.lin1(a))
            self.output = lambda i, a: layer.output_layer_norm(ffn.dropout(ffn.lin2(i)) + a)
        self.width, self.scaling = sa.attention_head_size, sa.scaling

    def attend(self, q, k, v, mask):
        """Attention context [N, tq, D] of queries q [N, tq, D] over keys / values [N, t, D]; `mask` a 4-D mask that
        broadcasts to [N, 1, tq, t] (or None)."""
        n, tq, _ = q.shape
        t = k.shape[1]
        q = q.reshape(n, tq, self.heads, self.width).transpose(1, 2)
        k, v = (x.reshape(n, t, self.heads, self.width).transpose(1, 2) for x in (k, v))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.sdpa_mask(mask, q.dtype),
                                                 scale=self.scaling)
        return context.transpose(1, 2).reshape(n, tq, self.heads * self.width)

    def finish(self, context, x):
        """The layer's output from the attention context and the layer's input rows (the residual)."""
        a = self.attended(context, x)
        return self.output(self.intermediate(a), a)


def _fast_ops(model) -> Optional[List[_Ops]]:
    """`_Ops` of every layer when the fast path applies to `model` now, else None: one module per layer of the
    Bert or DistilBERT layout with absolute positions and SDPA or eager attention (`layers.first_token.supported`),
    no forward hooks or replaced forwards on its parts (`layout.plain`: calling them in pieces computes what the
    layer computes) and no interventions registered."""
    st = models.structure(model)
    if len(st.layer_modules) != st.num_layers:
        return None
    for layer in st.layer_modules:
        if (not first_token.supported(layer) or interventions.active(layer) is not None
                or not layout.plain(*layer.modules())):
            return None
    return [_Ops(layer) for layer in st.layer_modules]


@dataclass
class _Clean:
    """The clean forward of one batch around layer ℓ (`_record`)."""

    layer: int
    cap: models.Capture  # at layer min(ℓ + 1, L): resume from h_{ℓ+1} (ℓ + 1 < L) or run the head (h_L)
    x: torch.Tensor  # input of layer ℓ [b, t, D]
    mask: Optional[torch.Tensor]  # layer ℓ's 4-D attention mask ([b, 1, 1 or t, t]) or None
    z: Dict[str, torch.Tensor]  # layer ℓ's components [b, t, width]
    x1: Optional[torch.Tensor] = None  # input of layer ℓ + 1
    mask1: Optional[torch.Tensor] = None
    z1: Dict[str, torch.Tensor] = field(default_factory=dict)  # layer ℓ + 1's query, key, value

    @property
    def last(self):
        return self.cap.layer  # L when ℓ >= L − 1


def _record(model, batch, layer) -> Optional[_Clean]:
    """One forward of `batch` (`models.capture` at layer min(ℓ + 1, L)) recording the inputs, masks and components
    of layers ℓ and ℓ + 1; None when a layer call passes what the fast path does not handle."""
    st = models.structure(model)
    L = st.num_layers
    nxt = layer + 1 if layer < L else None
    calls: Dict[int, object] = {}

    def pre(j):
        def hook(mod, args, kwargs):
            calls[j] = layout.call_arguments(args, kwargs)

        return hook

    store: Dict[Key, torch.Tensor] = {}

    def recorder(key):
        def fn(x):
            store[key] = x
            return x

        return fn

    wanted = [(layer, c) for c in models.COMPONENTS] + ([(nxt, c) for c in ("query", "key", "value")] if nxt else [])
    handles = [st.layer_modules[j - 1].register_forward_pre_hook(pre(j), with_kwargs=True)
               for j in ((layer, nxt) if nxt else (layer,))]
    try:
        with _interventions(model, [(key, recorder(key)) for key in wanted]):
            cap = models.capture(model, batch, min(layer + 1, L), rng=False)
    finally:
        for h in handles:
            h.remove()
    if any(calls.get(j) is None for j in ((layer, nxt) if nxt else (layer,))) or len(store) != len(wanted):
        return None
    x, mask = calls[layer]
    clean = _Clean(layer, cap, x, _key_mask(mask), {c: store[(layer, c)] for c in models.COMPONENTS})
    if nxt:
        clean.x1, mask1 = calls[nxt]
        clean.mask1 = _key_mask(mask1)
        clean.z1 = {c: store[(nxt, c)] for c in ("query", "key", "value")}
    return clean


def _key_mask(mask):
    """`mask` as [b, 1, 1, t] when every query row of it is the same (padding masks), else unchanged."""
    if mask is not None and mask.shape[-2] > 1 and torch.equal(mask, mask[:, :, :1].expand_as(mask)):
        return mask[:, :, :1]
    return mask


def _first_row_mask(mask):
    return mask if mask is None or mask.shape[-2] == 1 else mask[:, :, :1]


def _tile(x, k):
    """[b, ...] -> [k·b, ...]: k copies along the batch (copy-major, as `models.resume(repeat=k)`)."""
    return None if x is None else x.repeat(k, *([1] * (x.dim() - 1)))


def _copies(x, idx, values):
    """Row 0 of x [b, t, w] for k = len(idx) copies [k, b, w], copy j with its neuron idx[j] set to values[j]."""
    rows = x[:, 0].unsqueeze(0).repeat(idx.numel(), 1, 1)
    rows[torch.arange(idx.numel(), device=x.device), :, idx] = values.to(rows.dtype)[:, None]
    return rows


def _with_row0(x, row0):
    """x [b, t, w] tiled for the copies of row0 [k, b, w], row 0 of copy j replaced: [k·b, t, w]."""
    k = row0.shape[0]
    out = x.unsqueeze(0).repeat(k, 1, 1, 1)
    out[:, :, 0] = row0.to(out.dtype)
    return out.view(k * x.shape[0], *x.shape[1:])


def _fast_logits(model, ops: List[_Ops], clean: _Clean, comp, idx, values, prune):
    """Logits [k·b, C] of the k = len(idx) copies of the batch, copy j with neuron idx[j] of layer ℓ's `comp` set to
    values[j] at token 0 (`prune`: the head reads row 0 of the last layer only)."""
    layer, L = clean.layer, len(ops)
    op, z, x, mask = ops[layer - 1], clean.z, clean.x, clean.mask
    k, (b, t, _) = idx.numel(), x.shape
    if comp == "output":
        return _after_row0(model, ops, clean, _copies(z["output"], idx, values), prune)
    if comp == "intermediate":
        rows = _copies(z["intermediate"], idx, values)
        return _after_row0(model, ops, clean, op.output(rows, z["attention_output"][:, 0]), prune)
    if comp == "attention_output":
        a = _copies(z["attention_output"], idx, values)
        return _after_row0(model, ops, clean, op.output(op.intermediate(a), a), prune)
    if comp == "query":  # the copies' edited queries are k query rows of each sample against its clean keys
        q = _copies(z["query"], idx, values).transpose(0, 1)  # [b, k, D]
        context = op.attend(q, z["key"], z["value"], _first_row_mask(mask)).transpose(0, 1)  # [k, b, D]
        return _after_row0(model, ops, clean, op.finish(context, x[:, 0]), prune)
    # key / value: every row attends to the edited row 0
    kv = {c: _tile(z[c], k) for c in ("key", "value") if c != comp}
    kv[comp] = _with_row0(z[comp], _copies(z[comp], idx, values))
    if layer == L and prune:  # only row 0 reaches the head
        context = op.attend(_tile(z["query"][:, :1], k), kv["key"], kv["value"], _tile(_first_row_mask(mask), k))
        row0 = op.finish(context.view(k, b, 1, -1), x[:, :1]).view(k, b, -1)
        return _head(model, clean, _with_row0(clean.cap.hidden, row0))
    context = op.attend(_tile(z["query"], k), kv["key"], kv["value"], _tile(mask, k))
    h = op.finish(context.view(k, b, t, -1), x).view(k * b, t, -1)
    return _after_full(model, ops, clean, layer, h, prune)


def _after_row0(model, ops, clean: _Clean, row0, prune):
    """Logits from layer ℓ's output in row-0 form (row0 [k, b, D], the other rows clean)."""
    layer, L = clean.layer, len(ops)
    if layer == L:
        return _head(model, clean, _with_row0(clean.cap.hidden, row0))
    op, z1, mask1 = ops[layer], clean.z1, clean.mask1  # layer ℓ + 1: rows >= 1 project as in the clean forward
    k, b = row0.shape[:2]
    keys, vals = _with_row0(z1["key"], op.key(row0)), _with_row0(z1["value"], op.value(row0))
    if layer + 1 == L and prune:
        q = op.query(row0).reshape(k * b, 1, -1)
        context = op.attend(q, keys, vals, _tile(_first_row_mask(mask1), k))
        out = op.finish(context, row0.reshape(k * b, 1, -1)).view(k, b, -1)
        return _head(model, clean, _with_row0(clean.cap.hidden, out))
    context = op.attend(_with_row0(z1["query"], op.query(row0)), keys, vals, _tile(mask1, k))
    h = op.finish(context, _with_row0(clean.x1, row0))
    return _after_full(model, ops, clean, layer + 1, h, prune)


def _after_full(model, ops, clean: _Clean, m, h, prune):
    """Logits from the output of layer m (ℓ or ℓ + 1) in full form, h [k·b, t, D]."""
    L, k = len(ops), h.shape[0] // clean.x.shape[0]
    if m < clean.last:  # m = ℓ: run layer ℓ + 1 on every row (its input differs everywhere)
        op, mask1 = ops[m], clean.mask1
        if m + 1 == L and prune:
            context = op.attend(op.query(h[:, :1]), op.key(h), op.value(h), _tile(_first_row_mask(mask1), k))
            out = op.finish(context, h[:, :1]).view(k, -1, h.shape[-1])
            return _head(model, clean, _with_row0(clean.cap.hidden, out))
        h = op.finish(op.attend(op.query(h), op.key(h), op.value(h), _tile(mask1, k)), h)
        m += 1
    if m == L:
        return _head(model, clean, h)
    return models.logits_of(models.resume(model, clean.cap, h, first_token=prune, repeat=k))


def _head(model, clean: _Clean, h):
    """The model's own head on h_L stacked for the copies ([k·b, t, D])."""
    k = h.shape[0] // clean.x.shape[0]
    return models.logits_of(models.resume(model, clean.cap, h, repeat=k))


def sweep_flops(config, lengths, layers=None, components=models.COMPONENTS, *, first_token: bool = True,
                fast: bool = True) -> int:
    """The matmul FLOPs of `neuron_effects` in the encoder layers (the head's left out): projections, feed-forward
    and attention (``QKᵀ`` and ``AV``: 4·t·D per query row over t keys) for samples of these lengths (each sample's
    padded length in its batch; its real length for the floor), the `layers` and `components` swept.

    Per sample of length t (D the width, I the feed-forward width, P = 2D², F = 4DI, A(r) = 4·r·t·D, a whole
    layer W = t(4P + F) + A(t), a first-token layer W₁ = 2tP + 2P + F + A(1), the last layer Λ = W₁ with
    `first_token` (the model's head reads row 0 only, `models.first_token_ready`), else W):

    * clean forwards: L·W for the probabilities, and L·W per layer swept (the capture that records layers ℓ and
      ℓ + 1, or the input of layer ℓ for ``fast=False``);
    * ``fast=False`` (every copy resumes at layer ℓ): per neuron of layer ℓ, (L − ℓ)·W + Λ;
    * ``fast=True``, per neuron of layer ℓ: in layer ℓ, output 0, intermediate F/2 (its output projection),
      attention_output F, query P + F + A(1) (row 0 only), key / value t(P + F) + A(t) (no projections; with ℓ = L
      and `first_token`: P + F + A(1)); in layer ℓ + 1, after a row-0 edit 3P + t(P + F) + A(t) (the projections of
      row 0 only; with ℓ + 1 = L and `first_token`: 4P + F + A(1)), after a key / value edit W (W₁ when ℓ + 1 = L
      and `first_token`); layers ℓ + 2 .. L as the stacked path: (L − ℓ − 2)·W + Λ when ℓ + 2 ≤ L.
    """
    D = int(config.hidden_size)
    inner = getattr(config, "intermediate_size", None) or getattr(config, "hidden_dim", None)
    if inner is None:
        raise ValueError("config: expected intermediate_size (or DistilBERT's hidden_dim)")
    I, L = int(inner), int(config.num_hidden_layers)  # noqa: E741
    layers = range(1, L + 1) if layers is None else layers
    P, Fw = 2 * D * D, 4 * D * I
    total = 0
    for t in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths):
        t = int(t)

        def A(rows):
            return 4 * rows * t * D

        W = t * (4 * P + Fw) + A(t)
        W1 = 2 * t * P + 2 * P + Fw + A(1)
        last = W1 if first_token else W
        total += L * W
        for layer in layers:
            total += L * W
            for comp in components:
                width = I if comp == "intermediate" else D
                if not fast:
                    total += width * ((L - layer) * W + last)
                    continue
                rest = (L - layer - 2) * W + last if layer + 2 <= L else 0
                if comp in ("key", "value"):
                    own = P + Fw + A(1) if layer == L and first_token else t * (P + Fw) + A(t)
                    nxt = 0 if layer == L else (W1 if layer + 1 == L and first_token else W)
                else:
                    own = {"output": 0, "intermediate": Fw // 2, "attention_output": Fw,
                           "query": P + Fw + A(1)}[comp]
                    if layer == L:
                        nxt = 0
                    elif layer + 1 == L and first_token:
                        nxt = 4 * P + Fw + A(1)
                    else:
                        nxt = 3 * P + t * (P + Fw) + A(t)
                total += width * (own + nxt + rest)
    return total


@torch.no_grad()
def neuron_effects_looped(model, samples: dict, zbar: Dict[Key, torch.Tensor], target_class=0, components=None,
                          layers=None, batch_size: int = 128, neurons: Optional[Dict[Key, Sequence[int]]] = None
                          ) -> NeuronEffects:
    """The paper's method and the reference of `neuron_effects`: one whole forward of each batch (of `batch_size`
    samples padded to their longest) per neuron, with one intervention hook. `neurons` limits the sweep to some
    neurons per (layer, component) (the others are NaN): for timing a subset."""
    components, layers = _from_zbar(model, zbar, components, layers)
    target = _target(model, target_class)
    samples, n = _check_samples("samples", samples)
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
    samples, n = _check_samples("samples", samples)
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
