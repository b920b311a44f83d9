"""`cat_fast.step.CapturedStep` under DistributedDataParallel (`cat_fast.step_ddp`): steps outside DDP's forward that
average their own gradients equal the documented DDP loop (``loss = objective(batch)[0]; loss.backward();
opt.step()``) and keep the ranks identical. 2 processes: gloo on the CPU (``cuda_graph=False``, one spawn for every
case), NCCL on 2 GPUs (``cuda_graph=True``: captured collectives, ranks with different batch shapes in lockstep)."""
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from cat_fast import distributed as D
from cat_fast import gradient_averaging, step_ddp
from cat_fast.objectives import CAT, ERM, GradientSupervision, LearnedMixin
from cat_fast.step import CapturedStep, NotCapturable
from tests.conftest import tiny_batch, tiny_model
from tests.ranks import spawn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

WORLD, STEPS = 2, 3
BUCKET_MB = 0.02  # DDP's bucket_cap_mb in these tests: the tiny models' gradients in about 5 buckets
PAIRS = torch.tensor([1, 0, 3, 2])
CASES = ("erm", "cat", "gs-first-order", "learned-mixin", "erm-two-step", "erm-wrapped", "unused", "erm-compress-hook")


class _RankDependent(ERM):
    """ERM plus a term on a layer that only rank 0 reaches (``model.extra``); ``model.spare`` no rank reaches."""

    def __call__(self, batch, pairs=None):
        loss, info = super().__call__(batch)
        if D.rank() == 0:
            loss = loss + 0.1 * self.model.extra.weight.square().sum()
        return loss, info


def _batch(rank, step, device="cpu", length=9):
    b = tiny_batch("bert", batch=4, length=length, seed=100 * step + rank)
    b["labels"] = (torch.tensor([0, 1, 2, 0]) + step + rank) % 3
    b["bias"] = torch.randn(4, 3, generator=torch.Generator().manual_seed(7 + 100 * step + rank)).log_softmax(-1)
    return {k: v.to(device) for k, v in b.items()}


def _model(rank, case, device="cpu"):
    model = tiny_model("bert", num_layers=2, seed=rank).train()  # different weights: DDP broadcasts rank 0's
    if case == "unused":
        model.extra, model.spare = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    return model.to(device)


def _objective(case, model, ddp):
    """(objective, what the loop or CapturedStep calls)."""
    if case == "erm-wrapped":  # built on the model inside, wrapped (what the Trainer makes under torchrun)
        objective = ERM(model)
        return objective, D.DistributedObjective(objective, ddp)
    make = {"erm": lambda: ERM(ddp), "erm-compress-hook": lambda: ERM(ddp),
            "erm-two-step": lambda: ERM(ddp, two_step=True),
            "cat": lambda: CAT(ddp, layers=[1, 2], warmup_steps=1, generator=torch.Generator().manual_seed(0)),
            "gs-first-order": lambda: GradientSupervision(ddp, mode="first_order", low_memory=False),
            "learned-mixin": lambda: LearnedMixin(ddp), "unused": lambda: _RankDependent(ddp)}[case]
    objective = make()
    return objective, objective


def _train(rank, case, captured, device="cpu", lengths=None, steps=STEPS, graph=True):
    """Parameters, losses (and the CapturedStep's graph and replay counts) after `steps` steps of `case` (a case
    ending in "+copy": the CapturedStep's averager exchanges by the copy engines, `GradientAverager`'s "copy")."""
    case, _, exchange = case.partition("+")
    exchange, _, variant = exchange.partition("/")
    device = torch.device(device)
    clip = device.type == "cuda" and variant != "unclipped"
    model = _model(rank, case, device)
    # the reference is DDP's own: unused parameters need find_unused_parameters=True there
    # small buckets (about 1,000 gradients each), so that the step's update overlaps the last one's average
    ddp = DDP(model, find_unused_parameters=case == "unused" and not captured, bucket_cap_mb=BUCKET_MB,
              **({"device_ids": [device.index]} if device.type == "cuda" else {}))
    if case == "erm-compress-hook":  # the averager compresses as the hook does (bf16 needs NCCL: fp16 on gloo)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook if device.type == "cuda"
                               else default_hooks.fp16_compress_hook)
    torch.manual_seed(D.rank_seed(1))
    objective, call = _objective(case, model, ddp)
    params = list(model.parameters()) + list(objective.parameters())
    gpu = device.type == "cuda"
    opt = (torch.optim.AdamW(params, lr=torch.tensor(1e-3, device=device), capturable=True, fused=True) if gpu
           else torch.optim.SGD(params, lr=0.1))
    objective.set_optimizer(opt)
    # strict: a step that is not planned raises (only erm-two-step's call runs as the DDP loop's)
    saved = gradient_averaging.EXCHANGE, gradient_averaging.SPARSE_MIN_ROWS
    gradient_averaging.EXCHANGE = exchange or "nccl"
    gradient_averaging.SPARSE_MIN_ROWS = 100  # the tiny vocabulary (100 rows): exchanged by its rows with "copy"
    try:
        step = CapturedStep(call, opt, cuda_graph=gpu and graph, max_grad_norm=1.0 if clip else None,
                            skip_non_finite=gpu, warmup_steps=1, strict=case != "erm-two-step") if captured else None
    finally:
        gradient_averaging.EXCHANGE, gradient_averaging.SPARSE_MIN_ROWS = saved
    if step is not None and exchange:
        assert step.gradient_averager.exchange == exchange
        assert step.gradient_averager.sparse_exchanged == (exchange == "copy" and "compress" not in case)
    losses = []
    for i in range(steps):
        batch = _batch(rank, i, device, length=lengths[i] if lengths else 9)
        args = (PAIRS.to(device),) if objective.needs_pairs else ()
        if step is not None:
            loss, _ = step(batch, *args)
        else:
            loss, _ = call(batch, *args)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    state = {f"model.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    state.update({f"own.{i}": p.detach().cpu().clone() for i, p in enumerate(objective.parameters())})
    counts = (step.num_graphs, step.num_replays, step.gradient_averager.deferred) if step is not None else None
    return state, losses, counts


def _compare(results, cases, tolerance, route_of_step="captured"):
    """Every rank's parameters equal rank 0's bit for bit; the CapturedStep route's (`route_of_step`) equal the
    loop's within `tolerance`; each rank saw its own batches."""
    for case in cases:
        for route in ("loop", route_of_step):
            (s0, l0, c0), (s1, l1, c1) = (results[r][case, route] for r in range(WORLD))
            for key, value in s0.items():
                torch.testing.assert_close(s1[key], value, rtol=0, atol=0, msg=lambda m: f"{case} {route} {key}: {m}")
            assert l0 != l1 and c0 == c1, case
        for rank in range(WORLD):
            (want, want_losses, _), (got, losses, _) = results[rank][case, "loop"], results[rank][case, route_of_step]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **tolerance)
            start = _model(0, case).state_dict()
            moved = 0.0
            for key, value in want.items():
                torch.testing.assert_close(got[key], value, **tolerance, msg=lambda m: f"{case} rank {rank} {key}: {m}")
                if key.startswith("model.") and value.is_floating_point():
                    moved = max(moved, float((value - start[key[6:]].cpu()).abs().max()))
            assert moved > 1e-4, case  # the steps changed rank 0's initial weights


# ----------------------------------------------------------------------------- 2 processes, gloo, CPU

def _cpu_worker(rank, out):
    results = {(case, route): _train(rank, case, route == "captured")
               for case in CASES for route in ("loop", "captured")}
    lockstep = step_ddp.Lockstep()  # every rank's signatures in each key; `all` true only where true on every rank
    keys = [lockstep.agree(((("a",) if rank == 0 else ("x", i % 2)), ())) for i in range(3)]
    # the packed row counts: one kind on every rank (the largest of each), none, or kinds that differ (each its own)
    counts = [lockstep.agree((("s",), ()), rows, total) for rows, total in (
        ((100, 80, 20) if rank == 0 else (90, 90, 30), 400 + rank), (64 if rank == 0 else 96, 128),
        (None, 0), (50 if rank == 0 else None, 100 if rank == 0 else 0))]
    results["lockstep"] = [k[0][1][1] for k in keys], lockstep.all(rank == 0), lockstep.all(True), counts
    torch.save(results, f"{out}.{rank}")


@pytest.fixture(scope="module")
def spawned_cpu(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("step-ddp")
    spawn(_cpu_worker, str(tmp / "out"), tmp_path=tmp, world=WORLD)
    return [torch.load(f"{tmp / 'out'}.{r}", weights_only=False) for r in range(WORLD)]


def test_eager_ddp_steps_equal_the_ddp_loop(spawned_cpu):
    """ERM, CAT, first-order GS, a learned gate (its own hooks average it), erm-two-step (not planned: its call
    runs inside DDP's forward and its inner step all-reduces), a DistributedObjective, and a parameter only rank 0
    reaches (zeros from rank 1, the average on both, as DDP's find_unused_parameters=True gives), and ERM under
    DDP's fp16_compress_hook (the averager compressing as the hook does: the same 16-bit sums, so the same steps;
    not those of plain ERM; bf16's hook needs NCCL: the GPU test)."""
    _compare(spawned_cpu, CASES, dict(rtol=1e-6, atol=1e-6))
    for case in CASES:  # the SGD update of all but the last bucket's parameters overlapped that bucket's average
        deferred = spawned_cpu[0][case, "captured"][2][2]
        assert (deferred > 0) == (case != "erm-two-step"), (case, deferred)  # that one runs inside DDP's forward
    plain, compressed = spawned_cpu[0]["erm", "captured"][0], spawned_cpu[0]["erm-compress-hook", "captured"][0]
    hooked = spawned_cpu[0]["erm-compress-hook", "loop"][0]

    def gap(a, b):
        return max(float((a[k] - b[k]).abs().max()) for k in a if a[k].is_floating_point())

    assert gap(compressed, plain) > 1e-6 and gap(compressed, hooked) <= gap(compressed, plain) / 100


def test_lockstep_keys_name_every_rank(spawned_cpu):
    """`Lockstep.agree`: the key names every rank's padded signature; where every rank packs counts of one kind, each
    rank runs, and the key names, the ranks' largest of each count (and the largest batch); where none packs, none;
    where the kinds differ, each rank its own, the key every rank's."""
    (k0, no0, yes0, c0), (k1, no1, yes1, c1) = spawned_cpu[0]["lockstep"], spawned_cpu[1]["lockstep"]
    assert k0 == k1 == [(0, 0), (0, 1), (0, 0)]
    assert (no0, no1, yes0, yes1) == (False, False, True, True)
    key = (("s",), ((), (1, 2)))  # rank 0's second padded signature, rank 1's third
    assert c0[0] == c1[0] == (key, (100, 90, 30), (100, 90, 30), 401)
    assert c0[1] == c1[1] == (key, 96, 96, 128)
    assert c0[2] == c1[2] == (key, None, None, 0)
    assert c0[3] == (key, 50, ((50,), ()), 0) and c1[3] == (key, None, ((50,), ()), 0)


# ----------------------------------------------------------------------------- one process, gloo

@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _forward_calls(ddp):
    calls = []
    ddp.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


def test_planned_steps_run_outside_ddp_forward(process_group):
    """A planned step skips DDP's forward (its reducer stays idle); the objective still refuses plans outside
    CapturedStep; a step it does not plan (CAT's alternating update) runs inside DDP's forward."""
    model = tiny_model("bert", num_layers=2).train()
    ddp = DDP(model)
    calls = _forward_calls(ddp)
    objective = ERM(ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    CapturedStep(objective, opt, cuda_graph=False, strict=True)(_batch(0, 0))
    assert calls == [] and any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    with pytest.raises(NotCapturable, match="DistributedDataParallel"):
        objective.plan_step(_batch(0, 0))
    cat = CAT(ddp, update="alternate", generator=torch.Generator().manual_seed(0))
    cat.set_optimizer(opt)
    with pytest.raises(NotCapturable, match="alternate"):
        CapturedStep(cat, opt, cuda_graph=False, strict=True)(_batch(0, 0))
    CapturedStep(cat, opt, cuda_graph=False)(_batch(0, 0))
    assert calls == [1]


class _FindsUnused(ERM):
    find_unused_parameters = True


@pytest.mark.parametrize("case,reason", [("find-unused", "find_unused_parameters=True"),
                                         ("comm-hook", "communication hook"), ("batch-norm", "BatchNorm")])
def test_a_step_that_cannot_average_itself_says_why(process_group, case, reason):
    """strict: NotCapturable with the reason; otherwise the objective's own call inside DDP's forward."""
    model = tiny_model("bert", num_layers=2).train()
    if case == "batch-norm":
        model.norm = torch.nn.BatchNorm1d(4)
    ddp = DDP(model)
    if case == "comm-hook":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp.register_comm_hook(None, allreduce_hook)
    calls = _forward_calls(ddp)
    objective = (_FindsUnused if case == "find-unused" else ERM)(ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NotCapturable, match=reason):
        CapturedStep(objective, opt, cuda_graph=False, strict=True)(_batch(0, 0))
    CapturedStep(objective, opt, cuda_graph=False)(_batch(0, 0))
    assert calls == [1]


def test_a_hook_registered_after_the_step_was_built_is_not_skipped(process_group):
    """A communication hook registered after CapturedStep was built: strict, NotCapturable saying so; otherwise the
    steps run inside DDP's forward, whose reducer runs the hook."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    model = tiny_model("bert", num_layers=2).train()
    ddp = DDP(model)
    calls = _forward_calls(ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strict = CapturedStep(ERM(ddp), opt, cuda_graph=False, strict=True)
    lenient = CapturedStep(ERM(ddp), opt, cuda_graph=False)
    strict(_batch(0, 0))
    assert calls == []
    ddp.register_comm_hook(None, fp16_compress_hook)
    with pytest.raises(NotCapturable, match="registered on the DistributedDataParallel module after CapturedStep"):
        strict(_batch(0, 1))
    lenient(_batch(0, 1))
    assert calls == [1]


# ----------------------------------------------------------------------------- 2 GPUs, NCCL, CUDA graphs

# "/unclipped": no clipping, so the update of all but the last bucket's parameters overlaps that bucket's average
GPU_CASES = ("erm", "cat", "gs-first-order", "erm-compress-hook", "cat+copy", "erm-compress-hook+copy",
             "cat+copy/unclipped", "erm+nccl/unclipped")
GPU_STEPS = 8


def _gpu_worker(rank, out):
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    lengths = [9 if rank == 0 or i % 2 == 0 else 12 for i in range(GPU_STEPS)]  # rank 1's shapes change
    results = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        for case in GPU_CASES:  # the step outside DDP's forward, averaging itself: eager, and as CUDA graphs
            results[case, "loop"] = _train(rank, case, False, device, lengths, GPU_STEPS)
            results[case, "eager"] = _train(rank, case, True, device, lengths, GPU_STEPS, graph=False)
            results[case, "captured"] = _train(rank, case, True, device, lengths, GPU_STEPS)
    results["warnings"] = [str(w.message) for w in caught if "CapturedStep" in str(w.message)]  # a failed capture
    torch.save(results, f"{out}.{rank}")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                    reason="needs 2 CUDA devices and NCCL")
def test_gpu_ddp_steps_equal_the_ddp_loop_eager_and_captured(tmp_path):
    """On GPUs (NCCL) the step outside DDP's forward, averaging its own gradients (rank 1's batch length changes
    every step, rank 0's does not), equals the DDP loop (fp32, fused AdamW, clipping; and unclipped, the update of
    all but the last bucket's parameters overlapping that bucket's average), ranks bit-identical, both run
    eagerly and as CUDA graphs (all-reduces inside the graph; the ranks capture each pair of shapes together: one
    graph per pair of signatures, every later step a replay)."""
    spawn(_gpu_worker, str(tmp_path / "out"), tmp_path=tmp_path, world=WORLD, backend="nccl")
    results = [torch.load(f"{tmp_path / 'out'}.{r}", weights_only=False) for r in range(WORLD)]
    assert results[0]["warnings"] == results[1]["warnings"] == []
    for case in GPU_CASES:
        for result in results:
            graphs, replays, _ = result[case, "eager"][2]
            assert graphs == 0 and replays == 0, case
            graphs, replays, deferred = result[case, "captured"][2]
            assert graphs >= 1 and replays >= 2, (case, graphs, replays)
            assert (deferred > 0) == case.endswith("/unclipped"), (case, deferred)  # clipping needs every gradient
    for route in ("eager", "captured"):
        _compare(results, GPU_CASES, dict(rtol=1e-6, atol=1e-6), route)


def _packed_runs(rank, out, make_objective, packed_values=(False, True), steps=GPU_STEPS, reseed=False, share_rows=0.0,
                 last=lambda i: 3 + i % 3):
    """Captured steps of `make_objective(ddp)` under DDP as CUDA graphs, padded and with packed rows (each rank its
    own real rows, the ranks' largest counts packed): every rank's final state, losses, graph and replay counts,
    packed graphs, shared replays. `reseed`: the objective's generator is seeded with the batch's number before each
    step (its draws repeat with the batch); `share_rows`: `CapturedStep`'s (0: each count its own graph); ``last(i)``:
    step i's last sequence length."""
    from cat_fast.layers import training as training_layers

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    results = {}
    for packed in packed_values:
        training_layers.PACKED = packed
        model = tiny_model("bert", attn="sdpa", num_layers=4, seed=rank, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0).train().to(device)
        ddp = DDP(model, device_ids=[rank])
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device=device), capturable=True, fused=True)
        objective = make_objective(ddp)
        step = CapturedStep(objective, opt, warmup_steps=1, max_grad_norm=1.0, share_rows=share_rows)
        losses = []
        for i in range(steps):
            if reseed:
                objective.generator.manual_seed(i % 3)
            batch = _batch(rank, i % 3, device, length=24)
            cut = [24, 6 + 4 * rank, 9, last(i)]  # rank 1's rows and every step's last row differ
            lengths = torch.tensor(cut, device=device)[:, None]
            batch["attention_mask"] = (torch.arange(24, device=device) < lengths).long()
            losses.append(float(step(batch)[0]))
        results[packed] = ({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, losses,
                           step.num_graphs, step.num_replays, len(step._packed_graphs), step.num_shared_replays)
    training_layers.PACKED = "auto"
    torch.save(results, f"{out}.{rank}")


def _rising(i):
    """The last sequence 3, 7, 11 tokens long in turn: the ranks' largest counts (rank 1's) 48, 51 and 54 rows."""
    return 3 + 4 * (i % 3)


def _packed_worker(rank, out):
    """ERM(fast=True) under DDP as CUDA graphs, padded and with packed rows."""
    _packed_runs(rank, out, lambda ddp: ERM(ddp, fast=True), last=_rising)


def _packed_wrapped_worker(rank, out):
    """ERM(fast=True) built on the model inside and run through `DistributedObjective` (what the Trainer and the CLI
    make under torchrun), padded and with packed rows."""
    _packed_runs(rank, out, lambda ddp: D.DistributedObjective(ERM(ddp.module, fast=True), ddp), last=_rising)


def _shared_worker(rank, out):
    """ERM(fast=True) under DDP as CUDA graphs with packed rows, graphs shared (``share_rows=1/8``): the last
    sequence 11, 7, 3 tokens long in turn (the ranks' largest counts, rank 1's: 54, 51 and 48 of 96 rows, in 3-row
    buckets)."""
    _packed_runs(rank, out, lambda ddp: ERM(ddp, fast=True), steps=9, share_rows=0.125,
                 last=lambda i: 3 + 4 * (2 - i % 3))


def _packed_cat_worker(rank, out):
    """CAT under DDP as CUDA graphs, padded and with packed rows (``PACKED = True``: the rows a shorter partner lends
    too, up to the mixing layer); the partners and λ from one seeded CPU generator on both ranks, seeded again with
    each batch's number, so that a batch's packed row counts repeat with it."""
    _packed_runs(rank, out, lambda ddp: CAT(ddp, layers=[2], adv_steps=2, generator=torch.Generator().manual_seed(0)),
                 reseed=True)


def _check_packed_equals_padded(results, min_packed=2, min_replays=4):
    for result in results:
        graphs, replays, packed = result[True][2:5]
        assert result[False][4] == 0 and packed >= min_packed and replays >= min_replays, (graphs, replays, packed)
        want_state, want_losses = result[False][:2]
        state, losses = result[True][:2]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-4, atol=1e-5)
        for key, value in want_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
    for key, value in results[0][True][0].items():
        torch.testing.assert_close(results[1][True][0][key], value, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                    reason="needs 2 CUDA devices and NCCL")
def test_gpu_ddp_captured_steps_with_packed_rows_equal_padded(tmp_path):
    """Under DDP on 2 GPUs, captured ERM(fast=True) steps with packed rows (each rank its own real tokens, packed
    under the ranks' largest count: three counts, three graphs) equal the padded captured steps (fp32, no dropout) and
    keep the ranks bit-identical."""
    spawn(_packed_worker, str(tmp_path / "out"), tmp_path=tmp_path, world=WORLD, backend="nccl")
    _check_packed_equals_padded([torch.load(f"{tmp_path / 'out'}.{r}", weights_only=False) for r in range(WORLD)])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                    reason="needs 2 CUDA devices and NCCL")
def test_gpu_ddp_captured_steps_of_a_wrapped_objective_pack_rows(tmp_path):
    """The same through `DistributedObjective` (the Trainer's and the CLI's step under torchrun): the wrapped
    objective's rows are packed and the steps equal the padded ones. (CapturedStep used to ask the wrapper, which
    declares no packed rows, so every step of the Trainer and the CLI under torchrun ran padded.)"""
    spawn(_packed_wrapped_worker, str(tmp_path / "out"), tmp_path=tmp_path, world=WORLD, backend="nccl")
    _check_packed_equals_padded([torch.load(f"{tmp_path / 'out'}.{r}", weights_only=False) for r in range(WORLD)])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                    reason="needs 2 CUDA devices and NCCL")
def test_gpu_ddp_ranks_pack_their_largest_counts_and_share_graphs(tmp_path):
    """Under DDP the ranks agree on each step's packed row count (the larger of the two: rank 1's), so that their
    counts key one signature, and share graphs as on one process: after the batch shape's eager step (54 rows), the
    count of 51 rows is captured at once, the steps of 48 rows replay its graph (3 rows more, within 1/8 of 96), and
    54 rows get their own. The steps equal the padded captured ones and keep the ranks bit-identical."""
    spawn(_shared_worker, str(tmp_path / "out"), tmp_path=tmp_path, world=WORLD, backend="nccl")
    results = [torch.load(f"{tmp_path / 'out'}.{r}", weights_only=False) for r in range(WORLD)]
    for result in results:  # eager: step 0; steps 1 and 3 capture 51 and 54; 2, 5, 8 share 51's; 4, 6, 7 replay
        assert result[True][2:] == (2, 8, 2, 3), result[True][2:]
    _check_packed_equals_padded(results, min_packed=2)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                    reason="needs 2 CUDA devices and NCCL")
def test_gpu_ddp_captured_cat_with_packed_rows_equals_padded(tmp_path):
    """Under DDP on 2 GPUs, captured CAT steps with ``PACKED = True`` (each rank packing its own rows, a shorter
    partner's padding rows included) equal the padded captured steps (fp32, no dropout) and keep the ranks
    bit-identical."""
    spawn(_packed_cat_worker, str(tmp_path / "out"), tmp_path=tmp_path, world=WORLD, backend="nccl")
    # three batches, each with its partners: three signatures, each replayed from its third step on
    _check_packed_equals_padded([torch.load(f"{tmp_path / 'out'}.{r}", weights_only=False) for r in range(WORLD)])
