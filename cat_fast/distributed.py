"""Training on several processes with PyTorch's own DistributedDataParallel (DDP), one process per GPU (torchrun).

Wrap the Hugging Face model in DDP as usual, build the objective on the model (or on the DDP wrapper: objectives
unwrap ``.module``), and call the objective through `DistributedObjective`::

    device, rank, world = cat_fast.distributed.init_from_env(torch.device("cuda"))   # under torchrun
    ddp = torch.nn.parallel.DistributedDataParallel(model.to(device), device_ids=[device.index])
    objective = cat_fast.distributed.DistributedObjective(cat_fast.CAT(model, generator=g), ddp)
    loss, info = objective(batch)            # the objective's passes run INSIDE ddp's forward
    loss.backward(); opt.step(); opt.zero_grad()   # DDP averages the gradients once, during this backward

The objective's passes call the model's layers directly (captures, hooks, resumed layers), not ``model.forward``;
`run_in_forward` runs them as the DDP module's forward, so DDP's reducer sees the one backward of the returned loss
(gradients w.r.t. anything else inside the step — CAT's λ, GS's inputs — are not the reducer's business: it only
acts on a backward after its forward has returned). Local to a rank: its batch (whole counterfactual groups),
CAT's partners and λ, GS's pairs, dropout masks (seed + rank: `rank_seed`). Shared: CAT's mixing layer (one
stream seeded alike on every rank, so that the ranks do equal work each step). Global: the parameter gradients,
averaged by DDP, so parameters stay identical on every rank. Inner optimizer steps (CAT ``update="alternate"``,
``erm-two-step``) and CLP's Ω step all-reduce their own gradients (`Objective.inner_update`, `all_reduce_mean_`).
Refused, with the reason: GS ``low_memory=True`` (it writes ``.grad`` from a hook, outside DDP's reducer).

Compiled models: ``DDP(torch.compile(model))``, ``DDP(model)`` of a model compiled in place, and
``torch.compile(DDP(model))`` (what accelerate makes; give it or the DDP module inside to `DistributedObjective`).
DDP's own forward runs eagerly into the objective, whose passes run the original model uncompiled (`Objective`).
"""
from __future__ import annotations

import os
from typing import Iterable, Optional, Tuple

import torch
import torch.distributed as dist

from .models.structure import orig_module, unwrap

__all__ = ["init_from_env", "world", "rank", "rank_seed", "unwrap", "run_in_forward", "all_reduce_mean_",
           "broadcast_", "DistributedObjective"]


def init_from_env(device: torch.device) -> Tuple[torch.device, int, int]:
    """(device, rank, world size). Under torchrun (``WORLD_SIZE`` > 1) the default process group is initialised
    here (NCCL on CUDA, gloo on the CPU) and a CUDA `device` becomes ``cuda:LOCAL_RANK``; otherwise (device, 0, 1)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1 and not dist.is_initialized():
        return device, 0, 1
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device, dist.get_rank(), dist.get_world_size()


def world() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def rank_seed(seed: int) -> int:
    """``seed + rank``: each rank's own reproducible random stream (partners, λ, dropout)."""
    return int(seed) + rank()


_NONE = object()  # no forward set on the instance


def run_in_forward(ddp, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` run as the forward of the DistributedDataParallel module `ddp`, so that DDP prepares
    its reducer for the backward of what `fn` returns (and moves tensor arguments to its device). Inside `fn` the
    wrapped model has its own ``forward`` again, including one a wrapper installed on the instance (accelerate's
    mixed precision sets ``model.forward`` to an autocast version: the Trainer and the CLI under ``--bf16``), and
    the compiled call of a model compiled in place (``model.compile()``), which is set aside until `fn` starts (a
    compiled graph would trace `fn`). A torch.compile wrapper inside DDP (``DDP(torch.compile(model))``) has its
    forward replaced like a model's."""
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        return fn(*args, **kwargs)
    inner = ddp.module
    own = inner.__dict__.get("forward", _NONE)
    if getattr(own, "_cat_fast_trampoline", False):
        raise RuntimeError("run_in_forward: called from inside run_in_forward on the same model (a nested call)")
    compiled = inner.__dict__.get("_compiled_call_impl")

    def restore():
        if own is _NONE:
            inner.__dict__.pop("forward", None)
        else:
            inner.__dict__["forward"] = own
        if compiled is not None:
            inner._compiled_call_impl = compiled

    def trampoline(*a, **k):
        restore()  # the model's forward again for whatever `fn` calls
        return fn(*a, **k)

    trampoline._cat_fast_trampoline = True
    inner.__dict__["forward"] = trampoline
    if compiled is not None:
        inner._compiled_call_impl = None
    try:
        return ddp(*args, **kwargs)
    finally:
        if inner.__dict__.get("forward") is trampoline:
            restore()



def all_reduce_mean_(tensors: Iterable[Optional[torch.Tensor]], group=None) -> None:
    """Average `tensors` over the ranks in place, one all-reduce per dtype and device (None entries skipped)."""
    tensors = [t for t in tensors if t is not None]
    if not tensors or world() == 1:
        return
    size = dist.get_world_size(group)
    by_kind = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for group_tensors in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in group_tensors])
        dist.all_reduce(flat, group=group)
        flat /= size
        offset = 0
        for t in group_tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def broadcast_(tensors: Iterable[torch.Tensor], src: int = 0, group=None) -> None:
    """Rank `src`'s values of `tensors` on every rank (in place)."""
    if world() == 1:
        return
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src, group=group)


class DistributedObjective:
    """``loss, info = DistributedObjective(objective, ddp)(batch[, pairs])``: the objective run inside `ddp`'s
    forward (module docstring). On construction: `Objective.check_distributed` (a refused option raises a
    ValueError naming it), the objective's own parameters and state broadcast from rank 0 (a learned gate, CLP's
    Ω), gradient hooks that average those parameters' gradients, and ``objective.distributed = True`` (its inner
    updates all-reduce). ``reseed``: re-seed the objective's CPU generator with its seed + rank (a fresh run; a
    resumed one loads each rank's generator state instead). `ddp` may be torch.compile's wrapper of the DDP module
    (the DDP module inside is used: its forward is the objective's)."""

    def __init__(self, objective, ddp, reseed: bool = True):
        ddp = orig_module(ddp)
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"ddp: expected a torch.nn.parallel.DistributedDataParallel, got {type(ddp).__name__}")
        if objective.model is not unwrap(ddp):
            raise ValueError("objective: expected an objective built on the model that `ddp` wraps (ddp.module)")
        objective.check_distributed()
        self.objective = objective
        self.ddp = ddp
        objective.distributed = True
        own = [p for p in objective.parameters() if isinstance(p, torch.Tensor)]
        broadcast_(own + list(objective.distributed_state()))
        for p in own:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(_average_grad)
        generator = getattr(objective, "generator", None)
        if hasattr(objective, "layer_generator") and objective.layer_generator is None:
            # CAT: one mixing-layer stream on every rank (rank 0's seed); a resumed run restored its state already
            seed = [generator.initial_seed() if isinstance(generator, torch.Generator) else torch.initial_seed()]
            if world() > 1:
                dist.broadcast_object_list(seed, src=0)
            objective.layer_generator = torch.Generator().manual_seed(int(seed[0]) % 2**63)
        if reseed and isinstance(generator, torch.Generator):
            generator.manual_seed(generator.initial_seed() + rank())

    @property
    def model(self):
        return self.objective.model

    def __call__(self, batch, *args, **kwargs):
        return run_in_forward(self.ddp, self.objective, batch, *args, **kwargs)


def _average_grad(param):
    # an objective's own parameter (outside DDP): its accumulated gradient averaged over the ranks. Averaging the
    # accumulated sum again after each micro-batch is still the mean of the sums (averaging is linear).
    all_reduce_mean_([param.grad])
