"""cat_fast's objectives under DistributedDataParallel: 2 processes, gloo, CPU, tiny BERT (`cat_fast.distributed`).

One spawn runs every scenario (process start-up dominates); each rank saves its parameters after a few steps and
the parent compares them across ranks and with single-process runs."""
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from cat_fast import distributed as D
from cat_fast import models
from cat_fast.objectives import CAT, CLP, ERM, GradientSupervision, LearnedMixin, PoE
from tests.conftest import tiny_batch, tiny_model
from tests.ranks import spawn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

WORLD, B, STEPS = 2, 4, 4
PAIRS = torch.tensor([1, 0, 3, 2])  # groups of two inside each rank's batch of 4
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _batch(rank, step, bias=False):
    """Rank `rank`'s batch at `step` (rows of equal length, so that the ranks' batches concatenate)."""
    b = tiny_batch("bert", batch=B, length=9, seed=100 * step + rank)
    b["labels"] = (torch.tensor([0, 1, 2, 0]) + step + rank) % 3  # every pair of PAIRS has two labels
    if bias:
        g = torch.Generator().manual_seed(7 + 100 * step + rank)
        b["bias"] = torch.randn(B, 3, generator=g, dtype=torch.float64).log_softmax(-1)
    return b


def _global_batch(step, bias=False):
    parts = [_batch(r, step, bias) for r in range(WORLD)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _forced_draws(cat, offsets):
    """CAT's partners and λ fixed: the same permutation inside each block of B rows (block r offset by r·B) and λ
    from a fixed stream, so that two processes and one process on the concatenated batch mix the same rows."""
    perm = torch.tensor([2, 3, 1, 0])
    cat._draw_partner = lambda n, device: torch.cat([perm + o for o in offsets]).to(device)
    cat._draw_lambda = lambda n, device, dtype: torch.cat(
        [torch.linspace(0.2, 0.8, B, dtype=dtype) for _ in offsets]).to(device)


def _build(name, model, rank):
    """The objective `name` on `model`, with generators seeded by seed + rank."""
    g = torch.Generator().manual_seed(D.rank_seed(0) if rank is not None else 0)
    if name == "erm":
        return ERM(model)
    if name == "erm-two-step":
        return ERM(model, two_step=True, extra_lr=1e-2)
    if name in ("cat-sum", "cat-forced"):
        return CAT(model, layers=[2], generator=g, cuda_graph=False)
    if name == "cat-layers":
        return CAT(model, layers=[0, 1, 2], generator=g, cuda_graph=False)
    if name in ("cat-alternate", "cat-alternate-forced"):
        return CAT(model, layers=[2], generator=g, cuda_graph=False, update="alternate",
                   crm_optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    if name == "gs":
        return GradientSupervision(model)
    if name == "gs-first-order":
        return GradientSupervision(model, mode="first_order", low_memory=False)
    if name == "poe":
        return PoE(model)
    if name == "learned-mixin":
        return LearnedMixin(model)
    if name == "clp":
        return CLP(model, [_batch(9, 9)], virtual_lr=0.1, meta_lr=1e-2)
    raise ValueError(name)


EXACT = ("erm", "erm-two-step", "cat-forced", "cat-alternate-forced", "gs", "poe")  # equal to 1 process
DROPOUT = ("cat-sum", "cat-layers", "cat-alternate", "gs-first-order", "learned-mixin", "clp")  # ranks equal only


def _train(name, model, objective, call, rank):
    opt = torch.optim.SGD(list(model.parameters()) + objective.parameters(), lr=0.1)
    objective.set_optimizer(opt)
    bias = name in ("poe", "learned-mixin")
    losses, layers = [], []
    for step in range(STEPS):
        batch = _batch(rank, step, bias) if rank is not None else _global_batch(step, bias)
        args = (PAIRS if rank is not None else torch.cat([PAIRS + r * B for r in range(WORLD)]),) if (
            objective.needs_pairs) else ()
        loss, info = call(batch, *args)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        layers.append(int(info["layer"]) if "layer" in info else -1)
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    if name == "cat-layers":  # compared across ranks like the parameters: one mixing layer per step on every rank
        state["drawn_layers"] = torch.tensor(layers)
    state.update({f"own.{i}": p.detach().clone() for i, p in enumerate(objective.parameters())})
    if isinstance(objective, CLP):
        state.update({f"omega.{k}": v.clone() for k, v in objective.omega.state_dict().items()})
    return state, losses


def _model(name, seed):
    dtype = torch.float64
    extra = NO_DROPOUT if name in EXACT else {}
    return tiny_model("bert", seed=seed, dtype=dtype, **extra).train()


def _worker(rank, out):
    torch.manual_seed(D.rank_seed(0))
    results = {}
    for name in EXACT + DROPOUT:
        model = _model(name, seed=rank)  # different initial weights: DDP broadcasts rank 0's
        ddp = DDP(model)
        obj = D.DistributedObjective(_build(name, ddp, rank), ddp)
        if name.endswith("forced"):
            _forced_draws(obj.objective, [0])
        results[name] = _train(name, model, obj.objective, obj, rank)
    # the refusal, and gradients of an objective's passes that the reducer must not see twice
    gs = GradientSupervision(ddp.module, mode="first_order")
    try:
        D.DistributedObjective(gs, ddp)
        results["refused"] = ""
    except ValueError as error:
        results["refused"] = str(error)
    torch.save(results, f"{out}.{rank}")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    spawn(_worker, str(tmp / "out"), tmp_path=tmp, world=WORLD)
    return [torch.load(f"{tmp / 'out'}.{r}", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("name", EXACT + DROPOUT)
def test_parameters_identical_across_ranks(spawned, name):
    (s0, l0), (s1, l1) = spawned[0][name], spawned[1][name]
    start = _model(name, seed=0).state_dict()
    moved = 0.0
    for key, value in s0.items():
        torch.testing.assert_close(s1[key], value, rtol=0, atol=0)  # bit-identical: one averaged gradient
        if key.startswith("model.") and value.is_floating_point():
            moved = max(moved, float((value - start[key[6:]]).abs().max()))
    assert moved > 1e-4  # the steps changed rank 0's initial weights
    assert l0 != l1  # each rank saw its own batch


@pytest.mark.parametrize("name", EXACT)
def test_two_processes_equal_one_on_the_concatenated_batch(spawned, name):
    """DDP averages the ranks' per-batch mean losses: with equal per-rank batches that is the global batch's mean,
    so ERM, the bias-model losses and GS (pairs inside each rank's half; every rank with as many usable pairs, as
    GS averages over the usable pairs of a batch) take the single-process step. CAT is exact
    only with its draws forced: unforced, each rank draws partners among its own B rows and its own λ stream,
    which a single process drawing for all 2B rows cannot reproduce (cat-sum and cat-alternate are compared across
    ranks only)."""
    model = _model(name, seed=0)
    obj = _build(name, model, None)
    if name.endswith("forced"):
        _forced_draws(obj, [0, B])
    state, losses = _train(name, model, obj, obj, None)
    for key, want in state.items():
        torch.testing.assert_close(spawned[0][name][0][key], want, rtol=1e-9, atol=1e-11)
    mean = [(a + b) / 2 for a, b in zip(spawned[0][name][1], spawned[1][name][1])]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(losses), rtol=1e-9, atol=0)


def test_cat_ranks_share_the_mixing_layer_but_not_the_partners(spawned):
    """Every rank resumes from the same drawn layer each step (equal work, no straggler at the all-reduce); the
    draws vary over the steps, and the ranks' losses differ (their own batches, partners and λ)."""
    (s0, l0), (s1, l1) = spawned[0]["cat-layers"], spawned[1]["cat-layers"]
    assert torch.equal(s0["drawn_layers"], s1["drawn_layers"])
    assert len(set(s0["drawn_layers"].tolist())) > 1
    assert l0 != l1


def test_low_memory_first_order_gs_is_refused(spawned):
    assert "low_memory=True" in spawned[0]["refused"] and "reducer" in spawned[0]["refused"]


def test_run_in_forward_without_ddp_and_unwrap():
    model = tiny_model("bert")
    assert D.run_in_forward(model, lambda x: x + 1, 1) == 2
    assert models.unwrap(model) is model and D.world() == 1 and D.rank() == 0 and D.rank_seed(5) == 5
    with pytest.raises(TypeError, match="ddp: expected a torch.nn.parallel.DistributedDataParallel"):
        D.DistributedObjective(ERM(model), model)


def test_run_in_forward_keeps_a_forward_patched_on_the_instance(tmp_path):
    """accelerate's mixed precision sets ``model.forward`` on the instance (an autocast version): inside the
    objective the model's forward is that one, and afterwards it is still in place (it failed on 2 GPUs under
    ``cat-fast train --bf16`` before)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = tiny_model("bert")
        plain = model.forward
        calls = []

        def patched(*a, **k):
            calls.append(1)
            return plain(*a, **k)

        model.forward = patched
        ddp = DDP(model)
        batch = tiny_batch("bert", batch=2, length=5, seed=0)
        seen = []

        def fn(b):
            seen.append(model.forward)
            return model(**models.model_inputs(b)).logits.sum()

        loss = D.run_in_forward(ddp, fn, batch)
        loss.backward()
        assert seen == [patched] and calls == [1] and model.__dict__["forward"] is patched
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        del model.forward  # and a model without an instance forward gets none after the call
        D.run_in_forward(ddp, fn, batch)
        assert "forward" not in model.__dict__

        def marked(*a, **k):  # what a call from inside run_in_forward's own run would find installed
            raise AssertionError("not to be called")

        marked._cat_fast_trampoline = True
        model.forward = marked
        with pytest.raises(RuntimeError, match="nested call"):
            D.run_in_forward(ddp, fn, batch)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- 2 GPUs, NCCL (skipped elsewhere)

GPU_NAMES = ("erm", "cat-graphs", "gs-first-order")


def _gpu_worker(rank, out):
    torch.cuda.set_device(rank)
    torch.manual_seed(D.rank_seed(0))
    results = {}
    for name in GPU_NAMES:
        model = tiny_model("bert", seed=rank, attn="sdpa").cuda().train()
        ddp = DDP(model, device_ids=[rank])
        g = torch.Generator().manual_seed(0)
        objective = {"erm": lambda: ERM(ddp),
                     "cat-graphs": lambda: CAT(ddp, layers=[0, 1, 2], generator=g, cuda_graph=True),
                     "gs-first-order": lambda: GradientSupervision(ddp, mode="first_order", low_memory=False),
                     }[name]()
        obj = D.DistributedObjective(objective, ddp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step in range(5):
            batch = {k: v.cuda() for k, v in _batch(rank, step).items()}
            args = (PAIRS.cuda(),) if objective.needs_pairs else ()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = obj(batch, *args)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        graphs = objective.graphs.num_graphs if name == "cat-graphs" else -1
        results[name] = ({k: v.detach().cpu() for k, v in model.state_dict().items()}, losses, graphs)
    torch.save(results, f"{out}.{rank}")


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2
                         and dist.is_nccl_available()), reason="needs 2 CUDA devices and NCCL")
def test_gpu_nccl_ranks_identical_and_cat_graphs_captured(tmp_path):
    """On 2 GPUs with NCCL, bf16 autocast: parameters bit-identical across ranks after 5 AdamW steps of ERM, CAT
    (its CAL loop captured as CUDA graphs inside DDP's forward, on every rank) and GS first-order."""
    spawn(_gpu_worker, str(tmp_path / "out"), tmp_path=tmp_path, world=WORLD, backend="nccl")
    r0, r1 = (torch.load(f"{tmp_path / 'out'}.{r}", weights_only=False) for r in range(WORLD))
    for name in GPU_NAMES:
        (s0, l0, g0), (s1, l1, g1) = r0[name], r1[name]
        for key, value in s0.items():
            torch.testing.assert_close(s1[key], value, rtol=0, atol=0)
        assert all(x == x for x in l0 + l1) and l0 != l1
        if name == "cat-graphs":
            assert g0 >= 1 and g1 >= 1, (g0, g1)


def test_leave_destroys_the_groups_and_is_a_no_op_without_one(tmp_path):
    """`leave`: nothing without a process group; with one (a one-process gloo group and a group of its own, as
    CapturedStep's agreement makes), every group destroyed, and a second call is a no-op."""
    D.leave()
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        dist.new_group(backend="gloo")
        D.leave()
        assert not dist.is_initialized()
        D.leave()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
