"""A whole training step as one CUDA graph per batch signature (timings: benchmarks/RESULTS.md).

``step = CapturedStep(objective, optimizer, max_grad_norm=1.0, autocast=torch.bfloat16)`` and then, in a plain
loop, ``loss, info = step(batch)`` (``step(batch, pairs)`` for objectives with pairs). One step is the objective's
loss, its backward, optional gradient clipping (``clip_grad_norm_``, foreach, no host synchronisation), the
optimizer's step, all under autocast when `autocast` names a dtype. A host-bound step (small batches, where each
of a few thousand kernels costs its launch) then costs one graph launch.

How: each call first asks the objective for its plan of the step (`Objective.plan_step`: the host-side decisions,
made outside any graph: CAT's mixing layer, partners and λ). Per batch signature (the shapes and dtypes of the
batch's tensors, the plan's key and tensors), a few eager steps on a side stream come first (lazy initialisations,
the optimizer's state), then the step is captured into a graph whose inputs are static copies of the batch and of
the plan's tensors, and replayed: each call copies them in and replays. Dropout draws come from the CUDA
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
  update, first-order GS with ``low_memory=True``, and every objective under DistributedDataParallel, whose
  replayed step would skip DDP's forward and gradient averaging, raise `NotCapturable` with the reason);
  ``CapturedStep(..., cuda_graph=False)`` runs any objective eagerly;
- a step whose capture fails (a host synchronisation inside the model, an operation CUDA graphs do not
  support): that signature runs eagerly, with one warning naming the error; the results are the same.
Signatures beyond ``max_graphs`` run eagerly (pad batches to a few lengths: `cat_fast.data.length_buckets`).

``strict=True``: an objective whose step cannot be planned raises `NotCapturable` on every device (by default it
runs eagerly where nothing is captured: on the CPU and with ``cuda_graph=False``).

``skip_non_finite=True`` (a fused optimizer): a step whose loss or gradient norm is not finite leaves the
parameters and the optimizer's state as they were (the fused kernel's ``found_inf``, decided on the device: no
host synchronisation); the caller sees the loss. ``last_grad_norm``: the gradient norm before clipping of the
last step (a 0-d device tensor; with ``max_grad_norm``).
"""
from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping, Optional

import torch

from . import models

__all__ = ["CapturedStep", "NotCapturable", "StepPlan"]


class NotCapturable(RuntimeError):
    """An objective whose step cannot be replayed as a CUDA graph (the message says why)."""


@dataclass
class StepPlan:
    """The host-side part of one training step, decided before it runs (`Objective.plan_step`).

    ``key``: steps with equal keys (and batch signatures) replay one graph. ``state``: host values the step's
    graph is specialised on (CAT's mixing layer); equal keys mean equal states. ``tensors``: this step's own draws
    (partners, λ), static inputs of the graph, copied in before each replay. ``generators``: CUDA generators the
    step switches to inside the graph (registered with it before the capture). ``before_replay``: called on the
    host before each replay (sets those generators' offsets)."""

    key: Hashable = ()
    state: object = None
    tensors: dict = field(default_factory=dict)
    generators: tuple = ()
    before_replay: Optional[Callable[[], None]] = None


def _signature(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, Mapping):
        return tuple(sorted((k, _signature(v)) for k, v in value.items()))
    if isinstance(value, (tuple, list)):
        return tuple(_signature(v) for v in value)
    return ("value", repr(value))


def _static_like(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: _static_like(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_static_like(v) for v in value)
    return value


def _copy_into(static, value):
    if isinstance(static, torch.Tensor):
        static.copy_(value, non_blocking=True)
    elif isinstance(static, Mapping):
        for k in static:
            _copy_into(static[k], value[k])
    elif isinstance(static, (tuple, list)):
        for s, v in zip(static, value):
            _copy_into(s, v)


def _hyper_parameters(optimizer):
    """The optimizer's plain-number settings per group (those a capture bakes into the graph)."""
    return [tuple(sorted((k, v) for k, v in group.items() if isinstance(v, (int, float, bool))))
            for group in optimizer.param_groups]


class _Graph:
    def __init__(self, graph, inputs, loss, info, norm):
        self.graph, self.inputs, self.loss, self.info, self.norm = graph, inputs, loss, info, norm


def _detached(loss, info):
    return loss.detach(), {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in info.items()}


class CapturedStep:
    """One training step (module docstring); ``loss, info = step(batch[, pairs])``."""

    def __init__(self, objective, optimizer, *, max_grad_norm: Optional[float] = None, autocast=None,
                 cuda_graph: bool = True, warmup_steps: int = 3, max_graphs: int = 8, skip_non_finite: bool = False,
                 strict: bool = False):
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm: expected a positive number or None, got {max_grad_norm!r}")
        if autocast is not None and autocast not in (torch.bfloat16, torch.float16):
            raise ValueError(f"autocast: expected None, torch.bfloat16 or torch.float16, got {autocast!r}")
        if int(warmup_steps) != warmup_steps or warmup_steps < 1:
            raise ValueError(f"warmup_steps: expected an integer >= 1, got {warmup_steps!r}")
        if int(max_graphs) != max_graphs or max_graphs < 0:
            raise ValueError(f"max_graphs: expected an integer >= 0, got {max_graphs!r}")
        self.objective = objective
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.autocast = autocast
        self.cuda_graph = bool(cuda_graph)
        self.warmup_steps = int(warmup_steps)
        self.max_graphs = int(max_graphs)
        self.skip_non_finite = bool(skip_non_finite)
        self.strict = bool(strict)
        if self.skip_non_finite and not all(group.get("fused") for group in optimizer.param_groups):
            raise ValueError(f"optimizer: skip_non_finite=True needs a fused optimizer ({type(optimizer).__name__}("
                             "..., fused=True)), whose step the device skips on a non-finite loss or gradient norm")
        self.last_grad_norm = None  # the gradient norm before clipping of the last step (max_grad_norm)
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self._graphs = {}  # signature -> _Graph, or None (runs eagerly)
        self._seen = {}  # signature -> eager steps taken (the warm-up before its capture)
        self._pool = None
        self._hyper = None  # the optimizer's settings when the first graph was captured
        self._warned = set()
        if self.cuda_graph and self.params and self.params[0].is_cuda:  # elsewhere every step runs eagerly
            self._check_optimizer()

    @property
    def num_graphs(self) -> int:
        """Captured signatures."""
        return sum(g is not None for g in self._graphs.values())

    # ------------------------------------------------------------------ the step itself
    def _eager(self, plan, batch, args):
        """loss, backward, clipping, optimizer step: ``(loss, info, gradient norm or None)``, all detached; the
        gradients start from None (never a captured graph's). ``plan`` None: the objective's own call (an
        objective that plans nothing)."""
        device_type = next(iter(self.params)).device.type if self.params else "cpu"
        with torch.autocast(device_type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            if plan is None:
                loss, info = self.objective(batch, *args)
            else:
                loss, info = self.objective.planned_step(plan, batch, *args)
        loss.backward()
        norm = None
        if self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=True)
        if self.skip_non_finite:  # the device skips the update (and the step count) of a non-finite step
            bad = ~torch.isfinite(loss.detach().float())
            if norm is not None:
                bad = bad | ~torch.isfinite(norm)
            self.optimizer.found_inf = bad.to(torch.float32)
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
        else:
            self.optimizer.step()
        return (*_detached(loss, info), norm.detach() if norm is not None else None)

    def __call__(self, batch, *args):
        if not self.cuda_graph or not self.params or not self.params[0].is_cuda:
            try:
                plan = self.objective.plan_step(batch, *args)  # the same path as a replayed step, run eagerly
            except NotCapturable:
                if self.strict:
                    raise
                plan = None
            self.optimizer.zero_grad(set_to_none=True)
            loss, info, self.last_grad_norm = self._eager(plan, batch, args)
            self.optimizer.zero_grad(set_to_none=True)
            return loss, info
        plan = self.objective.plan_step(batch, *args)
        sig = (_signature(batch), _signature(args), plan.key, _signature(plan.tensors))
        graph = self._graphs.get(sig, False)
        if graph is False:
            seen = self._seen.get(sig, 0)
            if seen < self.warmup_steps or len(self._graphs) >= self.max_graphs:
                if len(self._graphs) >= self.max_graphs:
                    self._warn("limit", f"cat_fast CapturedStep: more than max_graphs={self.max_graphs} batch "
                                        "signatures; new ones run eagerly. Pad batches to a few lengths.")
                self._seen[sig] = seen + 1
                return self._side_stream_step(plan, batch, args)
            graph = self._graphs[sig] = self._capture(plan, batch, args)
        if graph is None:
            return self._side_stream_step(plan, batch, args)
        self._check_hyper_parameters()
        _copy_into(graph.inputs, (batch, args, plan.tensors))
        if plan.before_replay is not None:
            plan.before_replay()
        graph.graph.replay()
        self.last_grad_norm = graph.norm.clone() if graph.norm is not None else None
        return graph.loss.clone(), {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                    for k, v in graph.info.items()}

    def _side_stream_step(self, plan, batch, args):
        """An eager step (on a side stream, as PyTorch asks of the steps before a capture)."""
        device = self.params[0].device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self.optimizer.zero_grad(set_to_none=True)  # a captured graph's gradient buffers are not accumulated into
            loss, info, self.last_grad_norm = self._eager(plan, batch, args)
            self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.current_stream(device).wait_stream(side)
        return loss, info

    def _capture(self, plan, batch, args):
        """The step's graph for this signature (the capture runs nothing on the GPU: the caller replays it for this
        batch), or None when the capture fails (this signature then runs eagerly)."""
        device = self.params[0].device
        inputs = _static_like((batch, args, plan.tensors))
        static_plan = StepPlan(key=plan.key, state=plan.state, tensors=inputs[2], generators=plan.generators,
                               before_replay=plan.before_replay)
        box = []
        gc_was_enabled = gc.isenabled()
        # the objective's call runs once, on the host, during the capture, but no step happens: the replay that
        # follows is this batch's step (and `before_replay` counts it), so a counter the call advances is put back
        counted = getattr(self.objective, "step", None)
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            self.optimizer.zero_grad(set_to_none=True)
            graph = torch.cuda.CUDAGraph()
            for generator in plan.generators:
                graph.register_generator_state(generator)
            gc.collect()
            gc.disable()
            try:
                with models.graph_capture(graph, self._pool):
                    box.append(self._eager(static_plan, inputs[0], inputs[1]))
            finally:
                if gc_was_enabled:
                    gc.enable()
                if isinstance(counted, int):
                    self.objective.step = counted
        except Exception as error:  # noqa: BLE001 - any capture failure means: run this signature eagerly
            torch.cuda.synchronize(device)
            self.optimizer.zero_grad(set_to_none=True)
            self._warn(("capture", type(error).__name__),
                       f"cat_fast CapturedStep: the CUDA-graph capture of a {type(self.objective).__name__} step "
                       f"failed ({type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}); "
                       "this batch signature runs eagerly (same results).")
            return None
        if self._hyper is None:
            self._hyper = _hyper_parameters(self.optimizer)
        return _Graph(graph, inputs, *box[0])

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

    def _warn(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
