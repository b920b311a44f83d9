"""Every registered objective built on a DistributedDataParallel model and called in a plain loop (``loss, _ =
objective(batch); loss.backward(); opt.step()``) runs its passes inside DDP's forward, as
`cat_fast.distributed.DistributedObjective` does: 2 processes, gloo, CPU, tiny BERT. One spawn runs every objective
(process start-up dominates); each rank saves its parameters and the parent compares them across ranks."""
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from cat_fast import distributed as D
from cat_fast import objectives
from cat_fast.objectives import CAT, ERM, GradientSupervision
from cat_fast.objectives.debias import BiasObjective
from cat_fast.step import CapturedStep, NotCapturable
from tests.conftest import tiny_batch, tiny_model
from tests.ranks import spawn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

WORLD, B, STEPS = 2, 4, 3
PAIRS = torch.tensor([1, 0, 3, 2])  # groups of two inside each rank's batch of 4
ROUTES = ("built-on-ddp", "distributed-objective", "both")  # the three ways to run CAT under DDP, compared


def _batch(rank, step, entry=None):
    """Rank `rank`'s batch at `step`, with the bias model's log-probabilities and a teacher's probabilities for the
    objectives that read them."""
    b = tiny_batch("bert", batch=B, length=9, seed=100 * step + rank)
    b["labels"] = (torch.tensor([0, 1, 2, 0]) + step + rank) % 3  # every pair of PAIRS has two labels
    g = torch.Generator().manual_seed(7 + 100 * step + rank)
    if entry is not None and issubclass(entry.cls, BiasObjective):
        b["bias"] = torch.randn(B, 3, generator=g).log_softmax(-1)
    if entry is not None and getattr(entry.cls, "needs_teacher", False):
        b["teacher_probs"] = torch.randn(B, 3, generator=g).softmax(-1)
    return b


def _build(name, model):
    """The registered objective `name` on `model`, with what it needs besides the model."""
    entry = objectives.get(name)
    kwargs = {}
    if issubclass(entry.cls, CAT):
        kwargs["generator"] = torch.Generator().manual_seed(0)
    if getattr(entry.cls, "needs_meta", False):
        kwargs["meta_batches"] = [_batch(9, 9)]
    return objectives.build(name, model, **kwargs)


def _train(name, model, objective, call, rank):
    """Parameters (and the objective's own state) after `STEPS` plain-loop steps of `call`, and the losses."""
    entry = objectives.get(name)
    opt = torch.optim.SGD(list(model.parameters()) + list(objective.parameters()), lr=0.1)
    objective.set_optimizer(opt)
    losses = []
    for step in range(STEPS):
        args = (PAIRS,) if objective.needs_pairs else ()
        loss, _ = call(_batch(rank, step, entry), *args)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    state.update({f"own.{i}": p.detach().clone() for i, p in enumerate(objective.parameters())})
    if hasattr(objective, "omega"):  # CLP's perturbation network
        state.update({f"omega.{k}": v.clone() for k, v in objective.omega.state_dict().items()})
    return state, losses


def _model(seed):
    return tiny_model("bert", num_layers=2, seed=seed).train()


def _ddp(name, rank):
    model = _model(seed=rank)  # different initial weights: DDP broadcasts rank 0's
    find_unused = getattr(objectives.get(name).cls, "find_unused_parameters", False)
    return model, DDP(model, find_unused_parameters=find_unused)


def _worker(rank, out):
    results = {}
    for name in objectives.names():
        model, ddp = _ddp(name, rank)
        torch.manual_seed(D.rank_seed(1))
        objective = _build(name, ddp)
        results[name] = _train(name, model, objective, objective, rank)
        if name == "cat":  # the plain-loop route, compared with the other two below
            state, losses = results[name]
            results[ROUTES[0]] = {**state, "generator": objective.generator.get_state()}, losses
    for route in ROUTES[1:]:  # CAT on the model inside, wrapped; CAT built on the DDP model and wrapped as well
        model, ddp = _ddp("cat", rank)
        torch.manual_seed(D.rank_seed(1))
        objective = _build("cat", model if route == "distributed-objective" else ddp)
        state, losses = _train("cat", model, objective, D.DistributedObjective(objective, ddp), rank)
        results[route] = {**state, "generator": objective.generator.get_state()}, losses
    torch.save(results, f"{out}.{rank}")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp-objectives")
    spawn(_worker, str(tmp / "out"), tmp_path=tmp, world=WORLD)
    return [torch.load(f"{tmp / 'out'}.{r}", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("name", objectives.names())
def test_objective_built_on_ddp_keeps_ranks_identical(spawned, name):
    (s0, l0), (s1, l1) = spawned[0][name], spawned[1][name]
    start = _model(seed=0).state_dict()
    moved = 0.0
    for key, value in s0.items():
        torch.testing.assert_close(s1[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
        if key.startswith("model.") and value.is_floating_point():
            moved = max(moved, float((value - start[key[6:]]).abs().max()))
    assert moved > 1e-4  # the steps changed rank 0's initial weights
    assert l0 != l1  # each rank saw its own batch


def test_objective_built_on_ddp_equals_the_distributed_objective_route(spawned):
    """CAT built on the DDP model, CAT on the model inside wrapped in DistributedObjective, and CAT built on the DDP
    model and wrapped as well (no second wrap, no second re-seeding): the same steps on every rank."""
    for rank in range(WORLD):
        want, want_losses = spawned[rank]["distributed-objective"]
        for route in (ROUTES[0], ROUTES[2]):
            got, losses = spawned[rank][route]
            assert losses == want_losses, route
            for key, value in want.items():
                torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=lambda m: f"{route} {key}: {m}")


# ----------------------------------------------------------------------------- one process, gloo

@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _counted(ddp):
    """A list that grows by one on each call of `ddp`'s forward."""
    calls = []
    ddp.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


@pytest.mark.parametrize("how", ["ddp", "ddp(compiled)", "compiled(ddp)"])
def test_call_runs_inside_ddp_forward(process_group, how):
    """The DDP module found in the wrappers (DDP, DDP of a compiled model, torch.compile of DDP) runs each call's
    passes as its forward; DistributedObjective over such an objective delegates to it (no nested call)."""
    model = tiny_model("bert").train()
    if how == "ddp":
        wrapped = ddp = DDP(model)
    elif how == "ddp(compiled)":
        wrapped = ddp = DDP(torch.compile(model, backend="eager"))
    else:
        ddp = DDP(model)
        wrapped = torch.compile(ddp, backend="eager")
    calls = _counted(ddp)
    objective = ERM(wrapped)
    assert objective.ddp is ddp and objective.distributed and objective.model is model
    loss, _ = objective(_batch(0, 0))
    loss.backward()
    assert calls == [1]
    D.DistributedObjective(objective, wrapped)(_batch(0, 1))[0].backward()
    assert calls == [1, 1]


def test_distributed_objective_refuses_another_ddp(process_group):
    model = tiny_model("bert").train()
    objective = ERM(DDP(model))
    with pytest.raises(ValueError, match="objective: built on another DistributedDataParallel"):
        D.DistributedObjective(objective, DDP(model))


def test_cat_losses_refuses_a_ddp_built_cat(process_group):
    cat = CAT(DDP(tiny_model("bert").train()), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="outside DDP's forward"):
        cat.losses(_batch(0, 0))


def test_refused_option_raises_when_built_on_ddp(process_group):
    with pytest.raises(ValueError, match="low_memory=True .* pass low_memory=False"):
        GradientSupervision(DDP(tiny_model("bert")), mode="first_order")


def test_only_captured_step_plans_a_ddp_step(process_group):
    """CapturedStep plans a step under DDP and runs it outside DDP's forward, averaging the gradients itself
    (tests/test_step_ddp.py); an objective's own plan_step refuses it, with the reason."""
    model = tiny_model("bert").train()
    ddp = DDP(model)
    calls = _counted(ddp)
    objective = ERM(ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    CapturedStep(objective, opt, strict=True)(_batch(0, 0))
    assert calls == []
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    with pytest.raises(NotCapturable, match="DistributedDataParallel"):
        D.DistributedObjective(ERM(model), ddp).plan_step(_batch(0, 0))
    with pytest.raises(NotCapturable, match="CAT under DistributedDataParallel"):  # an objective's own plan_step
        CAT(ddp, generator=torch.Generator().manual_seed(0)).plan_step(_batch(0, 0))
