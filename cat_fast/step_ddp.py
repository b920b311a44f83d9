"""`cat_fast.step.CapturedStep` under DistributedDataParallel: the step runs outside DDP's forward and averages its
gradients itself, so that on a GPU the whole step, collectives included, is one CUDA graph.

``CapturedStep(objective, optimizer)`` with an objective under DDP (built on the DDP module, or wrapped in
`cat_fast.distributed.DistributedObjective`) runs each planned step as on one process: the objective's passes on the
unwrapped model, outside DDP's forward, so that DDP's reducer stays idle; `cat_fast.gradient_averaging.
GradientAverager` averages the gradients over the ranks (flat buffers made once, cut into buckets, each scaled by
1/world as DDP scales them and all-reduced as soon as the backward has finished its gradients, overlapped with the
rest of the backward; each ``.grad`` set to its view of the result); then clipping and the optimizer's step. On a GPU
the all-reduces are NCCL's, issued on the averager's stream, which joins the capture inside the captured region
(or, on GPUs of one host, the copy engines' pulls; the model's vocabulary tables, `gradient_averaging.
embedding_tables`, are then exchanged by the rows their gradients use).

Lockstep (`Lockstep`): a graph holding an NCCL collective must be captured and replayed by every rank together
(NCCL's rule: a captured collective is a collective property of the ranks). The ranks' batches may have different
shapes, so each step they exchange, over a gloo group on the host (no GPU synchronisation), a number naming their
local padded signature and their packed row counts; the graph cache is keyed on all ranks' numbers and, where every
rank packs, on the ranks' largest counts, which every rank then packs (so the ranks' counts key one graph, not one
per combination), and every rank warms up, captures, shares graphs (`cat_fast.step.CapturedStep`'s ``share_rows``)
and replays at the same steps; a capture that fails on one rank runs that step eagerly on all.

Semantics, as DDP's: a parameter with no gradient on this rank contributes zeros (every rank's buffer has every
parameter: no rank waits for another's different all-reduce) and then gets the average, like DDP's locally unused
parameters. A parameter no rank reaches gets zeros where DDP leaves None: objectives that declare
``find_unused_parameters = True`` are refused (`NotCapturable`), as are models whose buffers DDP would broadcast each
forward (BatchNorm's running statistics; BERT's buffers are constants) and DDP communication hooks other than
PyTorch's two compression hooks: with ``bf16_compress_hook`` or ``fp16_compress_hook`` registered (on DDP's own
process group) the averager compresses as the hook does (`GradientAverager`'s ``compress``: half the bytes, not
exact); any other hook is refused, since the averager would skip it, and so is a hook registered after the
`CapturedStep` was built. The objective's own parameters (a learned gate) are averaged by their gradient hooks
(`prepare_objective`), as in the plain loop. A step the objective does not plan (`NotCapturable`, ``strict=False``:
CAT's alternating update, ``erm-two-step``) runs the objective's own call inside DDP's forward, whose reducer
averages, and whose inner updates all-reduce themselves (`Objective.inner_update`).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from .distributed import DistributedObjective, ddp_module
from .gradient_averaging import BUCKET_MB, GradientAverager, embedding_tables
from .step import NotCapturable

__all__ = ["DDPStep", "GradientAverager", "Lockstep", "agreed_step", "compression", "ddp_of", "step_record"]


def ddp_of(objective):
    """``(objective that plans, DDP module)`` for an objective under DistributedDataParallel (built on the DDP
    module, or a `DistributedObjective`), else None."""
    if isinstance(objective, DistributedObjective):
        return objective.objective, objective.ddp
    ddp = getattr(objective, "ddp", None)
    if ddp is not None and getattr(objective, "distributed", False):
        return objective, ddp_module(ddp)
    return None


def step_record(number: int, rows=None, total: int = 0) -> list:
    """What a rank contributes to `Lockstep.agree`'s exchange: ``[number, total, how many counts, the counts, 0s]``
    (6 integers): `number` its padded signature's, `rows` its packed row counts (None, an int or a tuple of up to 3),
    `total` its batch's rows."""
    counts = () if rows is None else (rows if isinstance(rows, tuple) else (rows,))
    if len(counts) > 3:
        raise ValueError(f"rows: expected None, an int or up to 3 counts, got {rows!r}")
    return [int(number), int(total), len(counts), *(int(c) for c in counts), *(0,) * (3 - len(counts))]


def agreed_step(padded, rows, every):
    """`Lockstep.agree`'s result for this rank (`padded`, `rows` as there) from every rank's `step_record`, in rank
    order: the ranks' agreement without the exchange (`benchmarks/tools/cli_signatures.py` replays it on the
    host)."""
    key = padded[0], (padded[1], tuple(t[0] for t in every))
    kinds = {t[2] for t in every}
    if kinds == {0}:
        return key, None, None, 0
    if len(kinds) == 1:
        n = kinds.pop()
        top = tuple(max(t[3 + i] for t in every) for i in range(n))
        agreed = top if isinstance(rows, tuple) else top[0]
        return key, agreed, agreed, max(t[1] for t in every)
    return key, rows, tuple(tuple(t[3:3 + t[2]]) for t in every), 0


class Lockstep:
    """The ranks' agreement on each step's graph (module docstring): `agree` maps this rank's signature to one that
    names every rank's (and their packed row counts to the largest), and `all` tells whether a condition holds on
    every rank; both over a gloo group made on
    construction (a collective call: every rank builds its `Lockstep` at the same point). The group is its own
    even where the default one is gloo: a rank may agree while another rank's gradient collectives, issued during
    its backward, are still in flight on the default group, and the two must not be paired."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo")
        self.world = dist.get_world_size()
        self._ids = {}  # this rank's signatures -> small numbers, in the order first seen

    def agree(self, padded, rows=None, total: int = 0):
        """The ranks' step, agreed in one exchange: ``(key, rows, rows_key, total)``. `padded`: this rank's padded
        signature (``(its inputs' signature, the plan's key)``, `cat_fast.step.CapturedStep`); `rows`: its packed row
        counts (`cat_fast.step.static_row_counts`: None, an int or a tuple of up to 3), `total`: its batch's rows.
        `key`: `padded` with every rank's number for its padded signature. Where every rank packs counts of one kind
        (as many numbers), `rows` and `rows_key` are the ranks' largest of each count (every rank packs as many rows:
        one graph signature for every combination of the ranks' counts under it) and `total` the largest batch;
        where no rank packs, None, None, 0; else this rank's own counts, every rank's counts (the key) and 0."""
        local = torch.tensor(step_record(self._ids.setdefault(padded, len(self._ids)), rows, total),
                             dtype=torch.int64)
        every = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(every, local, group=self.group)
        return agreed_step(padded, rows, [t.tolist() for t in every])

    def all(self, ok: bool) -> bool:
        flag = torch.tensor([int(bool(ok))], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag)


def _refusal(planner, ddp) -> str | None:
    """Why a step of `planner` under `ddp` cannot run outside DDP's forward (module docstring), or None."""
    if getattr(planner, "find_unused_parameters", False):
        return ("it declares find_unused_parameters=True, and a parameter no rank reaches would get a zero gradient "
                "where DDP leaves None")
    if _skipped_hook(ddp):
        return ("the DistributedDataParallel module has a communication hook other than PyTorch's bf16_compress_hook "
                "or fp16_compress_hook on its own process group, which CapturedStep's all-reduce would skip")
    norms = torch.nn.modules.batchnorm._NormBase
    if ddp.broadcast_buffers and any(isinstance(m, norms) and m.track_running_stats for m in ddp.module.modules()):
        return ("the model has running statistics (BatchNorm), which DDP broadcasts at each forward and a step outside "
                "its forward does not (or pass broadcast_buffers=False to DDP)")
    return None


@functools.cache
def _compression_hooks():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {default_hooks.bf16_compress_hook: torch.bfloat16, default_hooks.fp16_compress_hook: torch.float16}


def compression(ddp):
    """The 16-bit dtype of `ddp`'s communication hook when it has exactly one and that is PyTorch's
    ``bf16_compress_hook`` or ``fp16_compress_hook`` over DDP's own process group (state None or that group); else
    None."""
    hooks = getattr(ddp, "_comm_hooks", None) or []
    if len(hooks) != 1:
        return None
    hook, state = hooks[0]
    dtype = _compression_hooks().get(hook)
    if dtype is None or not (state is None or state is ddp.process_group):
        return None
    return dtype


def _skipped_hook(ddp) -> bool:
    """Whether `ddp` has a communication hook that the averager does not apply (any but `compression`'s)."""
    return bool(getattr(ddp, "_comm_hooks", None)) and compression(ddp) is None


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
        for hook, state in getattr(ddp, "_comm_hooks", None) or ():  # the new reducer's, for steps in DDP's forward
            dist._register_comm_hook(ddp.reducer, state, hook)
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
        # the ranks' host-side agreement: on each step's graph, and on redoing an overlapped average (a collective
        # call: every rank builds its CapturedStep together)
        host = Lockstep() if self.reason is None and self.capture_reason is None else None
        self.lockstep = host if cuda_graph else None
        agree = (lambda flag: not host.all(not flag)) if host is not None else None
        bucket_mb = getattr(self.ddp, "bucket_bytes_cap", BUCKET_MB * 2**20) / 2**20  # DDP's bucket_cap_mb
        averaged = [p for p in params if id(p) not in own]
        ids = {id(p) for p in averaged}
        tables = [p for p in embedding_tables(self.ddp.module) if id(p) in ids]  # exchanged by their nonzero rows
        self.average = GradientAverager(averaged, agree=agree, bucket_mb=bucket_mb, sparse_rows=tables,
                                        compress=compression(self.ddp) if self.reason is None else None)

    def check(self):
        if self.capture_reason is not None:
            raise NotCapturable(f"a whole step under DistributedDataParallel is not captured as a CUDA graph: "
                                f"{self.capture_reason}; CapturedStep(..., cuda_graph=False) runs it eagerly")
        if self.reason is None and (compression(self.ddp) != self.average.compress or _skipped_hook(self.ddp)):
            self.reason = ("a communication hook was registered on the DistributedDataParallel module after "
                           "CapturedStep was built (build the CapturedStep after registering it)")
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
