"""A whole training step as one CUDA graph per batch signature (timings: benchmarks/RESULTS.md).

``step = CapturedStep(objective, optimizer, max_grad_norm=1.0, autocast=torch.bfloat16)`` and then, in a plain
loop, ``loss, info = step(batch)`` (``step(batch, pairs)`` for objectives with pairs). One step is the objective's
loss, its backward, optional gradient clipping (``clip_grad_norm_``, foreach, no host synchronisation), the
optimizer's step, all under autocast when `autocast` names a dtype. A host-bound step (small batches, where each
of its many kernels costs its launch) then costs one graph launch. The GPU tests (tests/test_step.py,
tests/test_graphs.py) compare the replayed steps with the eager loop's.

How: each call first asks the objective for its plan of the step (`Objective.plan_step`: the host-side decisions,
made outside any graph: CAT's mixing layer, partners and λ). Per batch signature (the shapes and dtypes of the
batch's tensors, the plan's key and tensors), a few eager steps on a side stream come first (lazy initialisations,
the optimizer's state), then the step is captured into a graph whose inputs are static copies of the batch and of
the plan's tensors, and replayed: each call copies them in and replays (the graphs, their static copies and their
memory pool are a `cat_fast.graphs.GraphCache`, the engine CAT's CAL loop uses too). Dropout draws come from the CUDA
generator, whose offset a replay advances exactly as the eager step does, so the masks are those of the eager
step; passes that redraw an earlier pass's masks (CAT's counterfactual passes) draw from generators the plan
names, registered with the graph and set before each replay. Gradients live in the graph's memory pool between
steps: do not zero or replace ``.grad`` between calls (the captured backward writes them; it does not accumulate).

What it refuses or runs eagerly, with the reason:
- the optimizer: its per-step state must live on the device (``capturable=True`` for Adam, AdamW and the
  other optimizers that take it). A learning rate or other hyper-parameter changed by a scheduler after the
  capture would not reach a graph that baked the old value: give the optimizer a tensor ``lr``
  (``lr=torch.tensor(2e-5)``, updated in place by PyTorch's schedulers), otherwise such a change raises;
- the objective: `Objective.plan_step` says whether its step can be replayed (a second step of the main
  optimizer inside the step or gradients written from a hook cannot: ERM's two-step control, CAT's alternating
  update, first-order GS with ``low_memory=True`` raise `NotCapturable` with the reason);
  ``CapturedStep(..., cuda_graph=False)`` runs any objective eagerly;
- a step whose capture fails (a host synchronisation inside the model, an operation CUDA graphs do not
  support): that signature runs eagerly, with one warning naming the error; the results are the same.
Signatures beyond ``max_graphs`` run eagerly (pad batches to a few lengths: `cat_fast.data.length_buckets`).

Padding-free graphs (`cat_fast.layers.training.PACKED`; by default "auto": on CUDA, for an objective that declares
`packs_rows` — ERM(fast=True), the bias-model losses, GS on the pooled vector or first order at the embeddings, CAT
— and batches of at least ``PACKED_MIN_ROWS`` rows, or the objective's own ``packed_min_rows``: CAT's 8,192 where
its lent rows take a gradient): a batch with a 2-D ``attention_mask`` adds its real-token count, rounded up to a 32nd
of its rows (`layers.packing.bucket`), to the signature, and its graph runs the encoder on that many packed rows
(`layers.packing.static_rows`: the rows packed once, handed from layer to layer packed, attended by variable-length
flash attention, read packed by a first-token last layer, unpacked once). Reading the count is one host
synchronisation per step, except from a batch given on the host: a dict of CPU tensors (pinned by a
``DataLoader(..., pin_memory=True)``: copied without a synchronisation) is moved to the parameters' device by the
step, and its count read from its host mask (CAT's rows depend on its partners: counted from their host copy,
`StepPlan.host`; CAT's graphs are keyed by the pair of its row counts, before and past the mixing layer,
`layers.packing.narrow`). The
signature's eager warm-up steps and its capture pack the same rows, so the offsets at which its passes redraw the
clean forward's dropout (`models.PassGenerators`) are measured on packed steps: by the capture itself where the
extension reads a generator's offset inside a capture (`ops.fused.rng_offset`: CUDA builds), else by an eager step
of the same rows. A batch whose first position is padding (left padding) runs padded, and so does a new row count
once packed graphs hold half of ``max_graphs``.

Packed graphs of one batch shape and plan key (its padded signature) share and warm up together. A packed step
whose row counts have no graph of their own replays a captured graph of its padded signature whose counts are each at
least its own (the extra rows are padding rows, computed and dropped as a static count's are: the same step) and
exceed them by at most ``share_rows`` (default `SHARE_ROWS`, 1/8) of the batch's rows in all, the fewest-row such
graph. The `warmup_steps` eager steps are counted over the padded signature's packed steps; once it has had them (or
a graph), a new row count is captured at first sight (`COUNT_WARMUP`: its capture measures its passes' dropout
offsets; without `ops.fused.rng_offset`, after one eager step of its own, which does). A signature that has shared
another graph `OWN_GRAPH_AFTER` times gets its own, so a long run replays its exact counts, while a short run whose
batches key dozens of counts runs few of its steps eagerly (benchmarks/RESULTS.md, "The CLI's default path on a
GPU"). ``share_rows=0`` replays only a step's own counts. Under DDP the ranks agree on
each step's counts first (every rank packs the ranks' largest of each: `step_ddp.Lockstep.agree`), so that their
counts key one graph and not one per combination, and then share and warm up alike; where the ranks pack counts of
different kinds (a rank that runs padded) each packs its own and the signature names every rank's.

``strict=True``: an objective whose step cannot be planned raises `NotCapturable` on every device (by default it
runs eagerly where nothing is captured: on the CPU and with ``cuda_graph=False``).

``skip_non_finite=True`` (a fused optimizer): a step whose loss or gradient norm is not finite leaves the
parameters and the optimizer's state as they were (the fused kernel's ``found_inf``, decided on the device: no
host synchronisation); the caller sees the loss. ``last_grad_norm``: the gradient norm before clipping of the
last step (a 0-d device tensor; with ``max_grad_norm``); ``last_skipped``: whether it was skipped (a 0-d device
tensor; with ``skip_non_finite``; under DDP true on every rank when true on one).

Under DistributedDataParallel (an objective built on the DDP module, or a `cat_fast.distributed.DistributedObjective`;
build the CapturedStep on every rank at the same point): each planned step runs outside DDP's forward and averages
its gradients itself (`cat_fast.step_ddp`); on GPUs the whole step, its all-reduces included, is one CUDA graph, the
ranks capturing and replaying together (DDP's reducer is rebuilt once on a side stream so that its gradient
accumulators can join a capture); on the CPU (gloo) every step is eager. Without ``max_grad_norm`` (clipping needs
every gradient first), and with one of PyTorch's per-parameter optimizers (`_PER_PARAMETER`, no step hooks), the
optimizer steps the parameters of every bucket but the last while the last one (the embeddings, which the backward
finishes last) is still averaged, then those: the same update, bit for bit, with the end of the exchange hidden.
On one process on CUDA, with ``OVERLAP_UPDATE`` (False by default) and under the same conditions, the optimizer
steps the parameters group by group during the backward, on a stream of its own, as their gradients are final
(`cat_fast.step_updates`): the same update, bit for bit.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Hashable, NamedTuple, Optional

import torch

from . import graphs as cuda_graphs
from .layers import packing
from .layers import training as training_layers
from .ops.fused import rng_offset_available
from .step_updates import BackwardUpdates, step_alone

__all__ = ["CapturedStep", "NotCapturable", "StepPlan", "Signature", "shared_graph", "static_row_counts",
           "with_rows"]


class NotCapturable(RuntimeError):
    """An objective whose step cannot be replayed as a CUDA graph (the message says why)."""


@dataclass
class StepPlan:
    """The host-side part of one training step, decided before it runs (`Objective.plan_step`).

    ``key``: steps with equal keys (and batch signatures) replay one graph. ``state``: host values the step's
    graph is specialised on (CAT's mixing layer); equal keys mean equal states. ``tensors``: this step's own draws
    (partners, λ), static inputs of the graph, copied in before each replay. ``generators``: CUDA generators the
    step switches to inside the graph (registered with it before the capture). ``before_replay``: called on the
    host before each replay (sets those generators' offsets). ``host``: CPU copies of some of ``tensors`` (CAT's
    partners), from which the packed row count is read without a host synchronisation (`static_row_counts`)."""

    key: Hashable = ()
    state: object = None
    tensors: dict = field(default_factory=dict)
    generators: tuple = ()
    before_replay: Optional[Callable[[], None]] = None
    host: dict = field(default_factory=dict)


def _hyper_parameters(optimizer):
    """The optimizer's plain-number settings per group (those a capture bakes into the graph)."""
    return [tuple(sorted((k, v) for k, v in group.items() if isinstance(v, (int, float, bool))))
            for group in optimizer.param_groups]


def _on_device(batch, device):
    """``(batch, host mask)``: a dict `batch` on a CUDA `device` with its CPU tensors moved there (pinned ones
    without a host synchronisation) and its ``attention_mask`` as given when that was a 2-D CPU tensor, else None;
    any other batch as it is, and None."""
    if not isinstance(batch, dict) or device.type != "cuda":
        return batch, None
    host = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"]
    if not host:
        return batch, None
    mask = batch.get("attention_mask")
    moved = dict(batch)
    for k in host:
        moved[k] = batch[k].to(device, non_blocking=batch[k].is_pinned())
    return moved, (mask if "attention_mask" in host and mask.dim() == 2 else None)


def _min_rows(objective) -> int:
    """The fewest rows (batch x length) of a batch that "auto" packs for `objective`: its own
    ``packed_min_rows`` (`Objective.packed_min_rows`: CAT's), else `layers.training.PACKED_MIN_ROWS`."""
    own = getattr(objective, "packed_min_rows", None)
    return training_layers.PACKED_MIN_ROWS if own is None else own


def static_row_counts(batch, objective, tensors=None, host_mask=None, host=None):
    """For an objective that declares `packs_rows`, with the training layers' packed path on
    (`layers.training.PACKED`; "auto": a CUDA batch of at least `_min_rows` rows): the real rows of the
    batch's 2-D ``attention_mask`` (or the rows the objective's ``packed_rows(batch, tensors)`` names, for the plan's
    `tensors`: CAT's) rounded up to a bucket (`layers.packing.bucket`), the row count its graph packs; else None.
    Where the objective also names the rows its layers past a narrowing pack (``narrowed_rows``: CAT's, past the
    mixing layer), the pair ``(n, n_narrowed)`` of the two counts (`layers.packing.static_rows`), when the second
    is smaller; where it carries the rows it names beyond the real tokens apart (``lent_rows_apart``), the triple
    ``(n, n_narrowed, n_lent)``: the real tokens up to the narrowing, its narrowed rows, the lent rows
    (`layers.packing.lent_bucket`). Reading the counts is one host synchronisation per step, paid only where the
    rows are packed, unless the mask's host copy is given (`host_mask`, the batch's mask as it came from the host:
    `_on_device`): then they are counted on the host, from the real tokens where the objective names no rows of its
    own, else from the rows it names for `host` (the plan's draws as host tensors, `StepPlan.host`; without them, on
    the device)."""
    mode = training_layers.packed_mode()
    if not mode or not isinstance(batch, dict):
        return None
    mask = batch.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.numel() == 0:
        return None
    if not getattr(objective, "packs_rows", False):  # its step runs padded (`Objective.packs_rows`)
        return None
    if mode == "auto" and not (mask.is_cuda and mask.numel() >= _min_rows(objective)):
        return None
    on_host = host_mask is not None and tuple(host_mask.shape) == tuple(mask.shape)
    if on_host and host and HOST_COUNTS:  # the objective's rows for its draws' host copies: no synchronisation
        batch, tensors = {"attention_mask": host_mask}, host
    rows = objective.packed_rows(batch, tensors or {})
    if rows is None and on_host:  # the real tokens, counted from the host mask
        batch = {"attention_mask": host_mask}
    apart = rows is not None and getattr(objective, "lent_rows_apart", False)  # `Objective.lent_rows_apart`
    n_rows, first_real, *more = _counts(objective, batch, tensors or {}, rows, apart)
    if not first_real:  # a sequence whose first position is padding (left padding) runs padded
        return None
    total = mask.numel()
    if apart:  # the real tokens up to the narrowing, the objective's narrowed rows past it, and the lent rows apart
        n_after, n_real = more if len(more) == 2 else (more[0], more[0])
        n = packing.bucket(n_real, total, training_layers.PACKED_MIN_PADDING)
        if n is None:
            return None
        n_narrow = packing.bucket(n_after, total, 0.0)
        return (n, n if n_narrow is None else n_narrow, packing.lent_bucket(n_rows - n_real, total))
    n = packing.bucket(n_rows, total, training_layers.PACKED_MIN_PADDING)
    if n is None or not more:
        return n
    # the layers past the mixing layer pack the objective's narrowed rows (`layers.packing.narrow`), fewer
    n_narrow = packing.bucket(more[0], total, 0.0)
    return n if n_narrow is None or n_narrow >= n else (n, n_narrow)


def _counts(objective, batch, tensors, rows, real=False):
    """``[rows, first position real in every sequence, narrowed rows, real tokens]`` as host numbers (the narrowed
    rows only where the objective names them, the real tokens only with `real`): `rows` (the objective's
    ``packed_rows`` for `batch` and `tensors`; None: the mask's real tokens), counted where they are (on the device:
    one synchronisation)."""
    mask = batch["attention_mask"]
    narrowed = getattr(objective, "narrowed_rows", None)  # `Objective.narrowed_rows`
    after = None if rows is None or narrowed is None else narrowed(batch, tensors)
    counted = [mask.count_nonzero() if rows is None else rows.count_nonzero(), mask[:, 0].bool().all()]
    if after is not None:
        counted.append(after.count_nonzero())
    if real:
        counted.append(mask.count_nonzero())
    return torch.stack(counted).tolist()


# `CapturedStep`'s ``share_rows`` where none is given: a packed step may replay a captured graph of its batch shape
# with at most this fraction of the batch's rows more than its own counts (module docstring; 0: its own counts only)
SHARE_ROWS = 0.125
# a signature that replayed another signature's graph this many times (``share_rows``) gets its own
OWN_GRAPH_AFTER = 16
# eager steps of its own before a new row count of a warm batch shape is captured (module docstring); a plan whose
# passes redraw the clean forward's dropout takes one where the capture cannot read the offsets (`_count_warmup`)
COUNT_WARMUP = 0


def _count_warmup(plan) -> int:
    if plan.before_replay is None or rng_offset_available():
        return COUNT_WARMUP
    return max(COUNT_WARMUP, 1)  # an eager step of the count's rows measures its passes' dropout offsets


def _counts_of(rows) -> tuple:
    return rows if isinstance(rows, tuple) else (rows,)


def with_rows(padded, rows):
    """The graph signature of a step of padded signature `padded` (``(inputs' signature, key)``) that packs `rows`
    (its key then names them), or `padded` where nothing packs (None)."""
    return padded if rows is None else (padded[0], (padded[1], ("rows", rows)))


def shared_graph(graphs, rows, total: int, slack: float):
    """Of `graphs` (``(signature, row counts)`` pairs: the captured packed graphs of one batch shape and plan key),
    the one whose counts are each at least `rows`'s and exceed them by at most ``slack * total`` rows in all (the
    fewest rows first), as its pair; else None. `rows`: a step's counts (`static_row_counts`: an int or a tuple)."""
    want = _counts_of(rows)
    best = None
    for sig, have in graphs:
        counts = _counts_of(have)
        if len(counts) != len(want) or any(h < w for h, w in zip(counts, want)):
            continue
        extra = sum(counts) - sum(want)
        if extra <= slack * total and (best is None or extra < best[0]):
            best = extra, (sig, have)
    return None if best is None else best[1]


class Signature(NamedTuple):
    """`CapturedStep.signature_of`'s answer: the graph signature a step keys, the padded one it falls back to (and
    under which its packed graphs are grouped for sharing: ``share_rows``) or None where it runs padded, and its packed
    row counts (`static_row_counts`) or None."""

    signature: Hashable
    padded: Optional[Hashable]
    rows: object


# PyTorch's optimizers whose update of a parameter reads only that parameter, its gradient and its own state: a step
# over a part of the parameters, then one over the rest (each skipping the parameters without a gradient), is their
# one step (tests/test_step.py checks it, bit for bit)
_PER_PARAMETER = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop")
SPLIT_UPDATE = True  # False: under DDP the optimizer waits for every bucket (for comparisons; `CapturedStep._update`)
# Whether a step on CUDA runs its optimizer step during its backward, group by group as the gradients are final, on a
# stream of its own (`cat_fast.step_updates.BackwardUpdates`): on one process, without ``max_grad_norm`` (clipping
# needs every gradient first) or ``skip_non_finite``, with one of PyTorch's per-parameter optimizers (`_splittable`):
# the same update, bit for bit. False by default; True turns it on.
OVERLAP_UPDATE = False
# The groups the parameters' elements are stepped in during the backward (`OVERLAP_UPDATE`)
OVERLAP_GROUPS = 8
# False: an objective's own packed rows (CAT's) are counted on the device even where the plan has host copies of its
# draws (one host synchronisation per step; for comparisons, `static_row_counts`)
HOST_COUNTS = True


def _splittable(optimizer) -> bool:
    """Whether `optimizer`'s step can be split by parameters (`CapturedStep._update`): one of `_PER_PARAMETER`
    exactly (not a subclass), with no step hooks (which would run twice)."""
    from torch.optim import optimizer as base

    # PyTorch's hook registries (not public); where a release names them otherwise, the step is not split
    hooks = [getattr(owner, name, None) for owner, name in (
        (optimizer, "_optimizer_step_pre_hooks"), (optimizer, "_optimizer_step_post_hooks"),
        (base, "_global_optimizer_pre_hooks"), (base, "_global_optimizer_post_hooks"))]
    return (type(optimizer) in tuple(getattr(torch.optim, name) for name in _PER_PARAMETER)
            and all(registry is not None and not registry for registry in hooks))


def _detached(loss, info):
    return loss.detach(), {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in info.items()}


class CapturedStep(cuda_graphs.CachedGraphs):
    """One training step (module docstring); ``loss, info = step(batch[, pairs])``."""

    def __init__(self, objective, optimizer, *, max_grad_norm: Optional[float] = None, autocast=None,
                 cuda_graph: bool = True, warmup_steps: int = 3, max_graphs: int = 8, skip_non_finite: bool = False,
                 strict: bool = False, share_rows: Optional[float] = None):
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm: expected a positive number or None, got {max_grad_norm!r}")
        if autocast is not None and autocast not in (torch.bfloat16, torch.float16):
            raise ValueError(f"autocast: expected None, torch.bfloat16 or torch.float16, got {autocast!r}")
        if int(warmup_steps) != warmup_steps or warmup_steps < 1:
            raise ValueError(f"warmup_steps: expected an integer >= 1, got {warmup_steps!r}")
        share_rows = SHARE_ROWS if share_rows is None else share_rows
        if isinstance(share_rows, bool) or not isinstance(share_rows, (int, float)) or not 0 <= share_rows <= 1:
            raise ValueError(f"share_rows: expected a fraction of a batch's rows in [0, 1], got {share_rows!r}")
        # the graphs per batch signature and plan key (`cat_fast.graphs`; checks max_graphs)
        self.cache = cuda_graphs.GraphCache(
            max_graphs, stacklevel=1, limit_warning="cat_fast CapturedStep: more than max_graphs={max_graphs} batch "
                                                    "signatures; new ones run eagerly. Pad batches to a few lengths.")
        self.objective = objective
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.autocast = autocast
        self.cuda_graph = bool(cuda_graph)
        self.warmup_steps = int(warmup_steps)
        self.skip_non_finite = bool(skip_non_finite)
        self.strict = bool(strict)
        if self.skip_non_finite and not all(group.get("fused") for group in optimizer.param_groups):
            raise ValueError(f"optimizer: skip_non_finite=True needs a fused optimizer ({type(optimizer).__name__}("
                             "..., fused=True)), whose step the device skips on a non-finite loss or gradient norm")
        self.last_grad_norm = None  # the gradient norm before clipping of the last step (max_grad_norm)
        self.last_skipped = None  # whether the last step was skipped (skip_non_finite)
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self._hyper = None  # the optimizer's settings when the first graph was captured
        graphs = self.cuda_graph and bool(self.params) and self.params[0].is_cuda  # elsewhere every step is eager
        if graphs:
            self._check_optimizer()
        self._ddp = None  # under DDP: `step_ddp.DDPStep` (plans outside DDP's forward, averaging, lockstep)
        self._packed_graphs = set()  # the signatures captured with packed rows (`static_row_counts`)
        self.share_rows = float(share_rows)
        self._families = {}  # padded signature -> [(packed signature, row counts)] captured (``share_rows``)
        self._shared = {}  # packed signature -> the steps it replayed another signature's graph
        self._family_steps = {}  # padded signature -> its packed signatures' eager steps
        from . import step_ddp

        if step_ddp.ddp_of(objective) is not None:
            self._ddp = step_ddp.DDPStep(objective, self.params, cuda_graph=graphs)
        self._planner = self._ddp.planner if self._ddp is not None else objective  # plan_step, planned_step

    @property
    def gradient_averager(self):
        """Under DDP, the `cat_fast.gradient_averaging.GradientAverager` of the planned steps (its ``buckets``, and
        ``overlapped``: those of the last captured or eager step reduced during its backward); else None."""
        return self._ddp.average if self._ddp is not None else None

    @property
    def num_packed_graphs(self) -> int:
        """Graphs captured with packed rows (`layers.training.PACKED`; at most half of ``max_graphs``)."""
        return sum(1 for sig in self._packed_graphs if self.cache.entries.get(sig) is not None)

    @property
    def num_replays(self) -> int:
        """Steps that replayed a graph."""
        return sum(entry.replays["step"] for entry in self.cache.entries.values() if entry is not None)

    @property
    def num_shared_replays(self) -> int:
        """Steps that replayed the graph of other row counts (``share_rows``; counted in `num_replays` too)."""
        return sum(self._shared.values())

    # ------------------------------------------------------------------ the step itself
    def _eager(self, plan, batch, args):
        """loss, backward, gradient averaging (under DDP), clipping, optimizer step: ``(loss, info, gradient norm or
        None, skipped or None)``, all detached; the gradients start from None (never a captured graph's). ``plan``
        None: the objective's own call (an objective that plans nothing; under DDP inside DDP's forward, whose
        reducer averages)."""
        device_type = next(iter(self.params)).device.type if self.params else "cpu"
        ddp = self._ddp if plan is not None else None
        if ddp is not None:  # counts the backward's gradient accumulations from here (overlap)
            ddp.average.begin(plan.key)
        updates = self._backward_updates() if self._ddp is None else None
        try:
            with torch.autocast(device_type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
                if plan is None:
                    loss, info = self.objective(batch, *args)
                else:
                    with ddp.outside_forward() if ddp is not None else contextlib.nullcontext():
                        loss, info = self._planner.planned_step(plan, batch, *args)
            with updates.during() if updates is not None else contextlib.nullcontext():
                loss.backward()
        except BaseException:
            if ddp is not None:
                ddp.average.abandon()
            raise
        if updates is not None:  # the update, partly run during the backward: its rest
            updates.finish()
            return (*_detached(loss, info), None, None)
        # the update overlaps the last bucket's average
        split = SPLIT_UPDATE and self.max_grad_norm is None and _splittable(self.optimizer)
        late = ddp.average(defer_last=split) if ddp is not None else []
        try:
            norm = bad = None
            if self.max_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=True)
            if self.skip_non_finite:  # the device skips the update (and the step count) of a non-finite step
                bad = ~torch.isfinite(loss.detach().float())
                if norm is not None:
                    bad = bad | ~torch.isfinite(norm)
                if self._ddp is not None:  # a rank's own loss: every rank skips where one does
                    bad = self._ddp.average.any(bad) > 0
                self.optimizer.found_inf = bad.to(torch.float32)
                try:
                    self._update(late)
                finally:
                    del self.optimizer.found_inf
            else:
                self._update(late)
        finally:
            if ddp is not None:
                ddp.average.finish()
        return (*_detached(loss, info), *(t.detach() if t is not None else None for t in (norm, bad)))

    def _backward_updates(self):
        """The `step_updates.BackwardUpdates` of this step's optimizer where `OVERLAP_UPDATE` applies, else None."""
        if OVERLAP_UPDATE is not True and OVERLAP_UPDATE is not False:
            raise ValueError(f"cat_fast.step.OVERLAP_UPDATE: expected True or False, got {OVERLAP_UPDATE!r}")
        if (not OVERLAP_UPDATE or self.max_grad_norm is not None or self.skip_non_finite or not self.params
                or not self.params[0].is_cuda or not _splittable(self.optimizer)):
            return None
        updates = getattr(self, "_updates", None)
        if updates is None or updates.groups != OVERLAP_GROUPS:
            updates = self._updates = BackwardUpdates(self.optimizer, self.params, OVERLAP_GROUPS)
        return updates

    def _update(self, late):
        """The optimizer's step. With `late` (under DDP, the parameters whose average is still in flight, their
        ``.grad`` None: `GradientAverager`'s ``defer_last``): a step of the others first, which overlaps that
        exchange, then, joined, a step of `late` alone. For an optimizer whose update is per parameter
        (`_splittable`) the two are the one step, bit for bit."""
        self.optimizer.step()
        if not late:
            return
        self._ddp.average.finish()
        step_alone(self.optimizer, self.params, late)

    def _plan(self, batch, args):
        """The objective's plan of this step (`Objective.plan_step`); under DDP, of a step outside DDP's forward."""
        if self._ddp is None:
            return self._planner.plan_step(batch, *args)
        self._ddp.check()
        with self._ddp.outside_forward():
            return self._planner.plan_step(batch, *args)

    def signature_of(self, batch, *args, cuda_counts: bool = False) -> Signature:
        """The graph signature a step on `batch` would key, without running it (for tools that count a run's graphs
        on the host: `benchmarks/tools/cli_signatures.py`): a `Signature`, ``(signature, padded, rows)``: `padded`
        the padded signature a packed step falls back to once packed graphs hold half of ``max_graphs`` (None where
        the step runs padded), `rows` its packed row counts, as on one process (under DDP the ranks' agreement is
        left out: `step_ddp.agreed_step` gives it from every rank's `step_ddp.step_record`). It plans the step
        (`Objective.plan_step`), so the objective's draws advance as a step's would.
        ``cuda_counts``: a CPU batch counted as the same batch on a GPU would be ("auto" packing, from the objective's
        least row count)."""
        plan = self._plan(batch, args)
        inputs = (batch, args, plan.tensors)
        padded = self.cache.signature(inputs, plan.key)
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        saved = training_layers.PACKED
        if (cuda_counts and saved == "auto" and isinstance(mask, torch.Tensor)
                and mask.numel() >= _min_rows(self._planner)):
            training_layers.PACKED = True
        try:
            host_mask = mask if isinstance(mask, torch.Tensor) and not mask.is_cuda else None
            rows = static_row_counts(batch, self._planner, plan.tensors, host_mask, plan.host)
        finally:
            training_layers.PACKED = saved
        if rows is None:
            return Signature(padded, None, None)
        return Signature(with_rows(padded, rows), padded, rows)

    def __call__(self, batch, *args):
        on_cuda = bool(self.params) and self.params[0].is_cuda
        host_mask = None
        if on_cuda:  # a batch given on the host: moved (module docstring)
            batch, host_mask = _on_device(batch, self.params[0].device)
        if not self.cuda_graph or not on_cuda:
            try:
                plan = self._plan(batch, args)  # the same path as a replayed step, run eagerly
            except NotCapturable:
                if self.strict:
                    raise
                plan = None
            self.optimizer.zero_grad(set_to_none=True)
            loss, info, self.last_grad_norm, self.last_skipped = self._eager(plan, batch, args)
            self.optimizer.zero_grad(set_to_none=True)
            return loss, info
        plan = self._plan(batch, args)
        inputs = (batch, args, plan.tensors)
        rows = static_row_counts(batch, self._planner, plan.tensors, host_mask, plan.host)  # under DDP: the planner
        lockstep = self._ddp.lockstep if self._ddp is not None else None
        # `rows`: the counts this rank packs; `key_rows`: those its signature keys (under DDP: agreed by the ranks)
        padded, rows, key_rows, total = self._agreed(inputs, plan, rows, batch, lockstep)
        sig = with_rows(padded, key_rows)
        warmup = self.warmup_steps
        shares = key_rows is not None and key_rows == rows  # every rank packs these counts: they share, warm together
        if shares and sig not in self.cache.entries:
            shared = self._shared_graph(sig, padded, rows, total)
            if shared is not None:
                sig, rows = shared
                key_rows = rows
            elif self._families.get(padded) or self._family_steps.get(padded, 0) >= self.warmup_steps:
                warmup = _count_warmup(plan)  # a warm batch shape: the capture measures the dropout offsets
        if (key_rows is not None and sig not in self.cache.entries
                and len(self._packed_graphs) >= self.cache.max_graphs // 2):
            rows = key_rows = None  # packed graphs hold half of max_graphs at most: the padded graph of this shape
            sig, warmup, shares = padded, self.warmup_steps, False
        entry = self.cache.get(sig)
        if entry is None and self.cache.admit(sig, warmup=warmup):
            entry = self._capture(sig, plan, inputs, rows)
            if key_rows is not None:
                self._packed_graphs.add(sig)
            if lockstep is not None and not lockstep.all(entry is not None):
                entry = self.cache.discard(sig)  # failed on another rank: eager on every rank
            if entry is not None and shares:
                self._families.setdefault(padded, []).append((sig, rows))
        if entry is None:  # a warm-up step, a failed capture or a signature beyond max_graphs
            if shares:
                self._family_steps[padded] = self._family_steps.get(padded, 0) + 1
            # a signature's eager steps pack as its graph does (a padded graph's, nothing): the same rows, so its
            # passes' dropout draws (`models.PassGenerators` measures their offsets on these steps) are the graph's
            with packing.static_rows(rows), packing.padded(rows is None):
                return self._side_stream_step(plan, batch, args)
        self._check_hyper_parameters()
        entry.load(inputs)
        if plan.before_replay is not None:
            with packing.static_rows(rows):
                plan.before_replay()
        entry.replay("step")
        loss, info, self.last_grad_norm, self.last_skipped = cuda_graphs.clone(entry.outputs["step"])
        return loss, info

    def _shared_graph(self, sig, family, rows, total):
        """``(signature, row counts)`` of the captured graph a packed step of signature `sig` (not captured) replays in
        its stead (``share_rows``, `shared_graph`), or None: none covers its counts, sharing is off, or `sig` has
        shared `OWN_GRAPH_AFTER` times (it gets its own)."""
        if self.share_rows <= 0 or self._shared.get(sig, 0) >= OWN_GRAPH_AFTER:
            return None
        held = [(s, r) for s, r in self._families.get(family, ()) if self.cache.entries.get(s) is not None]
        shared = shared_graph(held, rows, total, self.share_rows)
        if shared is not None:
            self._shared[sig] = self._shared.get(sig, 0) + 1
        return shared

    def _agreed(self, inputs, plan, rows, batch, lockstep):
        """``(padded signature, rows, key rows, total)`` of a step: its padded signature (the inputs' shapes and the
        plan's key), the packed row counts it runs (`rows`, or None), those its graph signature keys, and its batch's
        rows (0 where nothing packs). Under DDP (`lockstep`: the ranks' `step_ddp.Lockstep`) the ranks agree in one
        exchange (`Lockstep.agree`: every rank's numbers in the signature; where every rank packs, the ranks' largest
        counts, run by every rank)."""
        padded = self.cache.signature(inputs, plan.key)
        total = batch["attention_mask"].numel() if rows is not None else 0
        if lockstep is None:
            return padded, rows, rows, total
        return lockstep.agree(padded, rows, total)

    def _side_stream_step(self, plan, batch, args):
        """An eager step (on a side stream, as PyTorch asks of the steps before a capture)."""
        with cuda_graphs.side_stream(self.params[0].device):
            self.optimizer.zero_grad(set_to_none=True)  # a captured graph's gradient buffers are not accumulated into
            loss, info, self.last_grad_norm, self.last_skipped = self._eager(plan, batch, args)
            self.optimizer.zero_grad(set_to_none=True)
        return loss, info

    def _capture(self, sig, plan, inputs, rows=None):
        """The step's graphs for this signature (the capture runs nothing on the GPU: the caller replays it for this
        batch), or None when the capture fails (this signature then runs eagerly). `rows`: the training layers'
        static real-row count in this graph (`static_row_counts`), or None."""

        def build(static):
            batch, args, tensors = static
            static_plan = StepPlan(key=plan.key, state=plan.state, tensors=tensors, generators=plan.generators,
                                   before_replay=plan.before_replay)

            def step():
                with packing.static_rows(rows):
                    return self._eager(static_plan, batch, args)

            return {"step": step}

        def failed(reason):
            return (f"cat_fast CapturedStep: the CUDA-graph capture of a {type(self._planner).__name__} step failed "
                    f"({reason}); this batch signature runs eagerly (same results).")

        # the objective's call runs once, on the host, during the capture, but no step happens: the replay that
        # follows is this batch's step (and `before_replay` counts it), so a counter the call advances is put back
        counted = getattr(self._planner, "step", None)
        self.optimizer.zero_grad(set_to_none=True)
        try:
            entry = self.cache.capture(sig, inputs, build, device=self.params[0].device, generators=plan.generators,
                                       failed=failed)
        finally:
            if isinstance(counted, int):
                self._planner.step = counted
        if entry is None:
            self.optimizer.zero_grad(set_to_none=True)
        elif self._hyper is None:
            self._hyper = _hyper_parameters(self.optimizer)
        return entry

    # ------------------------------------------------------------------ checks
    def _check_optimizer(self):
        for group in self.optimizer.param_groups:
            if "capturable" in group and not group["capturable"]:
                raise ValueError(f"optimizer: {type(self.optimizer).__name__} must be built with capturable=True "
                                 "for CapturedStep (its step counter then lives on the device), or pass "
                                 "cuda_graph=False")

    def _check_hyper_parameters(self):
        if self._hyper is not None and _hyper_parameters(self.optimizer) != self._hyper:
            raise ValueError("optimizer: a learning rate or another setting changed after the step was captured, "
                             "and the graph replays the old value. Give the optimizer a tensor lr "
                             "(lr=torch.tensor(...), which schedulers update in place), or pass cuda_graph=False")
