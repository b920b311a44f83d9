"""Training on several processes with PyTorch's own DistributedDataParallel (DDP), one process per GPU (torchrun).

Wrap the Hugging Face model in DDP as usual and build the objective on the DDP module::

    device, rank, world = cat_fast.distributed.init_from_env(torch.device("cuda"))   # under torchrun
    ddp = torch.nn.parallel.DistributedDataParallel(model.to(device), device_ids=[device.index])
    objective = cat_fast.CAT(ddp, generator=g)   # prepared on construction: g re-seeded with seed + rank
    objective.load_state_dict(state)         # (a resumed run: each rank's own generator state, after construction)
    loss, info = objective(batch)            # the objective's passes run INSIDE ddp's forward
    loss.backward(); opt.step(); opt.zero_grad()   # DDP averages the gradients once, during this backward

An objective built on a DDP module (or on torch.compile's wrapper of one, or on DDP of a compiled model) remembers
it (``objective.ddp``) and runs every call inside its forward. The same, for an objective built on the model
inside: ``DistributedObjective(objective, ddp)`` (what `cat_fast.integrations.ObjectiveTrainer` makes under
torchrun); over an objective built on that DDP module it only delegates (no second preparation or re-seeding).
A whole step as one CUDA graph: ``CapturedStep(objective or DistributedObjective, optimizer)`` on every rank
(`cat_fast.step`), whose steps run outside DDP's forward and average the gradients themselves (`cat_fast.step_ddp`).

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
``torch.compile(DDP(model))`` (what accelerate makes; build the objective on it, or give it or the DDP module
inside to `DistributedObjective`). DDP's own forward runs eagerly into the objective, whose passes run the original
model uncompiled (`Objective`).
"""
from __future__ import annotations

import gc
import os
from typing import Iterable, Optional, Tuple

import torch
import torch.distributed as dist

from .models.structure import orig_module, unwrap

__all__ = ["init_from_env", "leave", "world", "rank", "rank_seed", "unwrap", "ddp_module", "run_in_forward",
           "all_reduce_mean_", "broadcast_", "prepare_objective", "DistributedObjective"]


def init_from_env(device: torch.device) -> Tuple[torch.device, int, int]:
    """(device, rank, world size). Under torchrun (``WORLD_SIZE`` > 1) the default process group is initialised
    here (NCCL on CUDA, gloo on the CPU) and a CUDA `device` becomes ``cuda:LOCAL_RANK``; otherwise (device, 0, 1).
    A gradient exchange named in the environment that is not one is refused first (ValueError)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1 and not dist.is_initialized():
        return device, 0, 1
    from .gradient_averaging import checked_exchange

    checked_exchange()
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device, dist.get_rank(), dist.get_world_size()


def leave() -> None:
    """Leaves the process group, where one is initialised: garbage first, then every group destroyed. An object in
    a reference cycle (a DDP reducer, a CapturedStep's gloo agreement group) that outlived `destroy_process_group`
    would drop a group's last reference later, with the GIL held or while the interpreter shuts down, where gloo's
    destructor can wait for ever or abort the process (tests/ranks.py)."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def world() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def rank_seed(seed: int) -> int:
    """``seed + rank``: each rank's own reproducible random stream (partners, λ, dropout)."""
    return int(seed) + rank()


def ddp_module(model):
    """The DistributedDataParallel module among `model`'s wrappers (`model` itself, the DDP module inside
    torch.compile's wrapper, or DDP around a compiled model), else None."""
    model = orig_module(model)
    return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None


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


def prepare_objective(objective, reseed: bool = True) -> None:
    """Ready `objective` to train under DDP, once (later calls do nothing): `Objective.check_distributed` (a
    refused option raises a ValueError naming it), the objective's own parameters and state broadcast from rank 0
    (a learned gate, CLP's Ω), gradient hooks that average those parameters' gradients, CAT's mixing-layer stream
    seeded alike on every rank, and ``objective.distributed = True`` (its inner updates all-reduce). ``reseed``:
    re-seed the objective's CPU generator with its seed + rank (a fresh run; a resumed one loads each rank's
    generator state afterwards). An objective built on a DDP module is prepared so on construction."""
    if getattr(objective, "_ddp_prepared", False):
        return
    objective.check_distributed()
    objective.distributed = True
    objective._ddp_prepared = True
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


class DistributedObjective:
    """``loss, info = DistributedObjective(objective, ddp)(batch[, pairs])``: the objective run inside `ddp`'s
    forward (module docstring), for an objective built on the model inside `ddp`; on construction
    `prepare_objective(objective, reseed)`. Over an objective built on `ddp` itself (prepared already, and running
    inside its forward by itself) it delegates. `ddp` may be torch.compile's wrapper of the DDP module (the DDP
    module inside is used: its forward is the objective's)."""

    def __init__(self, objective, ddp, reseed: bool = True):
        ddp = orig_module(ddp)
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"ddp: expected a torch.nn.parallel.DistributedDataParallel, got {type(ddp).__name__}")
        if objective.model is not unwrap(ddp):
            raise ValueError("objective: expected an objective built on the model that `ddp` wraps (ddp.module)")
        if getattr(objective, "ddp", None) not in (None, ddp):
            raise ValueError("objective: built on another DistributedDataParallel module than `ddp`; build it on "
                             "`ddp` (and call it directly) or on the model inside (ddp.module)")
        prepare_objective(objective, reseed)
        self.objective = objective
        self.ddp = ddp

    @property
    def model(self):
        return self.objective.model

    def __call__(self, batch, *args, **kwargs):
        if getattr(self.objective, "ddp", None) is self.ddp:
            return self.objective(batch, *args, **kwargs)  # it runs inside ddp's forward by itself
        return run_in_forward(self.ddp, self.objective, batch, *args, **kwargs)

    def plan_step(self, batch, *args):
        """The objective's answer: `cat_fast.step.NotCapturable` (a step under DDP is replayable only inside
        `cat_fast.step.CapturedStep`, which plans it from the objective inside: `cat_fast.step_ddp`)."""
        return self.objective.plan_step(batch, *args)


def _average_grad(param):
    # an objective's own parameter (outside DDP): its accumulated gradient averaged over the ranks. Averaging the
    # accumulated sum again after each micro-batch is still the mean of the sums (averaging is linear).
    all_reduce_mean_([param.grad])
