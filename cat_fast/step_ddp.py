"""`cat_fast.step.CapturedStep` under DistributedDataParallel: the step runs outside DDP's forward and averages its
gradients itself, so that on a GPU the whole step, collectives included, is one CUDA graph.

``CapturedStep(objective, optimizer)`` with an objective under DDP (built on the DDP module, or wrapped in
`cat_fast.distributed.DistributedObjective`) runs each planned step as on one process: the objective's passes on the
unwrapped model, outside DDP's forward, so that DDP's reducer stays idle; then `GradientAverager` averages the
gradients over the ranks (each dtype's gradients copied into one flat buffer made once, scaled by 1/world as DDP
scales them, one all-reduce per buffer, each ``.grad`` set to its view of the result); then clipping and the
optimizer's step. On a GPU the all-reduces are NCCL's, issued on the capture stream inside the captured region
(the eager warm-up steps before a capture run them on a side stream, as every eager step of `CapturedStep` does).

Lockstep (`Lockstep`): a graph holding an NCCL collective must be captured and replayed by every rank together
(NCCL's rule: a captured collective is a collective property of the ranks). The ranks' batches may have different
shapes, so each step they exchange, over a gloo group on the host (no GPU synchronisation), a number naming their
local signature; the graph cache is keyed on all ranks' numbers, so every rank warms up, captures and replays at
the same steps, and a capture that fails on one rank runs that step eagerly on all.

Semantics, as DDP's: a parameter with no gradient on this rank contributes zeros (every rank's buffer has every
parameter: no rank waits for another's different all-reduce) and then gets the average, like DDP's locally unused
parameters. A parameter no rank reaches gets zeros where DDP leaves None: objectives that declare
``find_unused_parameters = True`` are refused (`NotCapturable`), as are DDP communication hooks and models whose
buffers DDP would broadcast each forward (BatchNorm's running statistics; BERT's buffers are constants). The
objective's own parameters (a learned gate) are averaged by their gradient hooks (`prepare_objective`), as in the
plain loop. A step the objective does not plan (`NotCapturable`, ``strict=False``: CAT's alternating update,
``erm-two-step``) runs the objective's own call inside DDP's forward, whose reducer averages, and whose inner
updates all-reduce themselves (`Objective.inner_update`).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .distributed import DistributedObjective, ddp_module
from .step import NotCapturable

__all__ = ["DDPStep", "GradientAverager", "Lockstep", "ddp_of"]


def ddp_of(objective):
    """``(objective that plans, DDP module)`` for an objective under DistributedDataParallel (built on the DDP
    module, or a `DistributedObjective`), else None."""
    if isinstance(objective, DistributedObjective):
        return objective.objective, objective.ddp
    ddp = getattr(objective, "ddp", None)
    if ddp is not None and getattr(objective, "distributed", False):
        return objective, ddp_module(ddp)
    return None


class GradientAverager:
    """``averager()``: the gradients of `params` averaged over the ranks of `group` in place of DDP's reducer
    (module docstring); the flat buffers, one per dtype and device, are made on construction."""

    def __init__(self, params, group=None):
        self.group = group
        self.world = dist.get_world_size(group)
        kinds = {}
        for p in params:
            kinds.setdefault((p.dtype, p.device), []).append(p)
        self.buckets = []  # (flat buffer, parameters, their views of it); none on one process (nothing to average)
        for (dtype, device), members in kinds.items() if self.world > 1 else ():
            flat = torch.zeros(sum(p.numel() for p in members), dtype=dtype, device=device)
            views, offset = [], 0
            for p in members:
                views.append(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            self.buckets.append((flat, members, views))

    def __call__(self):
        for flat, members, views in self.buckets:
            grads = [(v, p.grad) for p, v in zip(members, views) if p.grad is not None and p.grad is not v]
            if grads:
                torch._foreach_copy_([v for v, _ in grads], [g for _, g in grads])
            unused = [v for p, v in zip(members, views) if p.grad is None]
            if unused:  # zeros from this rank, so that every rank reduces the same buffer
                torch._foreach_zero_(unused)
            flat.mul_(1.0 / self.world)  # as DDP: each rank's share scaled before the sum
            dist.all_reduce(flat, group=self.group)
            for p, v in zip(members, views):
                p.grad = v

    def any(self, flag):
        """`flag` (a 0-d tensor, nonzero = true) made true on every rank where it is on one (an all-reduce of its max)."""
        flag = flag.to(torch.float32).reshape(1)
        if self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return flag[0]


class Lockstep:
    """The ranks' agreement on each step's graph (module docstring): `key` maps this rank's signature to one that
    names every rank's, and `all` tells whether a condition holds on every rank; both over a gloo group made on
    construction (a collective call: every rank builds its `Lockstep` at the same point)."""

    def __init__(self):
        self.group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self.world = dist.get_world_size()
        self._ids = {}  # this rank's signatures -> small numbers, in the order first seen

    def key(self, sig):
        local = torch.tensor([self._ids.setdefault(sig, len(self._ids))], dtype=torch.int64)
        every = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(every, local, group=self.group)
        return sig[0], (sig[1], tuple(int(t) for t in every))

    def all(self, ok: bool) -> bool:
        flag = torch.tensor([int(bool(ok))], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag)


def _refusal(planner, ddp) -> str | None:
    """Why a step of `planner` under `ddp` cannot run outside DDP's forward (module docstring), or None."""
    if getattr(planner, "find_unused_parameters", False):
        return ("it declares find_unused_parameters=True, and a parameter no rank reaches would get a zero gradient "
                "where DDP leaves None")
    if getattr(ddp, "_comm_hooks", None):
        return "the DistributedDataParallel module has a communication hook, which CapturedStep's all-reduce skips"
    norms = torch.nn.modules.batchnorm._NormBase
    if ddp.broadcast_buffers and any(isinstance(m, norms) and m.track_running_stats for m in ddp.module.modules()):
        return ("the model has running statistics (BatchNorm), which DDP broadcasts at each forward and a step outside "
                "its forward does not (or pass broadcast_buffers=False to DDP)")
    return None


def accumulators_off_the_default_stream(ddp) -> str | None:
    """Rebuilds `ddp`'s reducer under a new side stream, so that the gradient accumulators it holds (made when DDP
    was built, and kept alive by it) belong to that stream; None, or why it could not be done.

    The autograd engine runs each parameter's gradient accumulation on the stream its accumulator was made on. DDP
    makes them on the stream current at its construction, usually the legacy default stream, and a backward
    captured on another stream then has to make the legacy stream wait on the capturing one, which CUDA refuses
    (``cudaErrorStreamCaptureImplicit``). On a side stream of its own, the accumulation joins the capture like any
    forked stream. The rebuild is the one DDP runs when unpickled (``__setstate__``)."""
    needed = ("_build_params_for_reducer", "_build_debug_param_to_name_mapping", "_ddp_init_helper")
    if not all(hasattr(ddp, name) for name in needed):
        return "this PyTorch's DistributedDataParallel does not rebuild its reducer as this code expects"
    stream = torch.cuda.Stream(next(ddp.module.parameters()).device)
    stream.wait_stream(torch.cuda.current_stream())
    ddp.reducer = ddp.logger = None  # the old accumulators go with the reducer, so that new ones are made
    with torch.cuda.stream(stream):
        parameters, sparse = ddp._build_params_for_reducer()
        ddp._ddp_init_helper(parameters, sparse, ddp._build_debug_param_to_name_mapping(parameters), ddp.static_graph)
        if ddp.static_graph:
            ddp.reducer._set_static_graph()
            ddp.logger._set_static_graph()
    torch.cuda.current_stream().wait_stream(stream)
    ddp._cat_fast_accumulation_stream = stream
    return None


class DDPStep:
    """What `cat_fast.step.CapturedStep` needs for an objective under DDP (module docstring): the objective that
    plans (``planner``), the refusal (`check`), the block in which its plans and steps run outside DDP's forward
    (`outside_forward`), the gradient averaging (``average``) and, with CUDA graphs, the ranks' `Lockstep`."""

    def __init__(self, objective, params, cuda_graph: bool):
        self.planner, self.ddp = ddp_of(objective)
        self.reason = _refusal(self.planner, self.ddp)
        self.capture_reason = None
        if cuda_graph and self.reason is None and getattr(self.ddp, "_cat_fast_accumulation_stream", None) is None:
            self.capture_reason = accumulators_off_the_default_stream(self.ddp)
        own = {id(p) for p in self.planner.parameters()}  # averaged by their own gradient hooks
        self.average = GradientAverager([p for p in params if id(p) not in own])
        # the ranks' agreement on each step's graph (a collective call: every rank builds its CapturedStep together)
        self.lockstep = Lockstep() if cuda_graph and self.reason is None and self.capture_reason is None else None

    def check(self):
        if self.capture_reason is not None:
            raise NotCapturable(f"a whole step under DistributedDataParallel is not captured as a CUDA graph: "
                                f"{self.capture_reason}; CapturedStep(..., cuda_graph=False) runs it eagerly")
        if self.reason is not None:
            raise NotCapturable(f"{type(self.planner).__name__} under DistributedDataParallel cannot average its own "
                                f"gradients: {self.reason}; CapturedStep(..., cuda_graph=False) without strict=True "
                                "runs its steps inside DDP's forward")

    @contextlib.contextmanager
    def outside_forward(self):
        """The objective's calls run directly, not as DDP's forward (`Objective`'s routing), and its ``plan_step``
        plans steps under DDP (`Objective.check_capturable`): the gradients are averaged by the caller."""
        planner = self.planner
        saved = planner.__dict__.get("_in_ddp_forward", False), planner.__dict__.get("_averaged_by_step", False)
        planner._in_ddp_forward = planner._averaged_by_step = True
        try:
            yield
        finally:
            planner._in_ddp_forward, planner._averaged_by_step = saved
