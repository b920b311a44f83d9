"""Compiled models: the objectives take ``torch.compile(model)`` and ``model.compile()`` (alone or with
DistributedDataParallel) and compute exactly what they compute on the uncompiled model, because their passes run
the original module's own forward; afterwards no hook or patch is left and the compiled model runs its graph as
before. A model with only compiled submodules, and interventions on a compiled model, are refused."""
import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounter
from torch.nn.parallel import DistributedDataParallel as DDP

from cat_fast import distributed as D
from cat_fast import models
from cat_fast.objectives import CAT, CLP, ERM, GradientSupervision, PoE
from tests.conftest import tiny_batch, tiny_model

PAIRS = torch.tensor([1, 0, 3, 2])
OBJECTIVES = ("cat", "cat-warmup", "gs-exact", "gs-exact-layer", "gs-first-order", "erm", "erm-two-step", "poe",
              "clp")


def _batch(step):
    b = tiny_batch("bert", batch=4, length=9, seed=10 + step)
    b["labels"] = (torch.tensor([0, 1, 2, 0]) + step) % 3  # every pair of PAIRS has two labels
    b["bias"] = torch.randn(4, 3, generator=torch.Generator().manual_seed(step)).log_softmax(-1)
    return b


def _objective(name, model):
    g = torch.Generator().manual_seed(0)
    if name == "cat":
        return CAT(model, layers=[1, 2], generator=g)
    if name == "cat-warmup":  # warm-up and alternate ERM steps without pruning: plain forwards (compiled)
        return CAT(model, layers=[2], generator=g, warmup_steps=1, prune_last_layer=False, update="alternate",
                   crm_optimizer=torch.optim.SGD(models.unwrap(model).parameters(), lr=0.1))
    if name == "gs-exact":
        return GradientSupervision(model)
    if name == "gs-exact-layer":  # double backward through the eager attention of layers 2..3
        return GradientSupervision(model, representation=1)
    if name == "gs-first-order":  # its perturbed passes run inside loss.backward() (low_memory)
        return GradientSupervision(model, mode="first_order")
    if name == "gs-first-order-ddp":  # low_memory=True is refused under DDP
        return GradientSupervision(model, mode="first_order", low_memory=False)
    if name == "erm":
        return ERM(model)
    if name == "erm-two-step":
        return ERM(model, two_step=True, extra_lr=1e-2)
    if name == "poe":
        return PoE(model)
    if name == "clp":  # a hook on the head in its own forward; its perturbation network drawn from seed 1
        torch.manual_seed(1)
        return CLP(model, [_batch(9)], virtual_lr=0.1, meta_lr=1e-2)
    raise ValueError(name)


def _steps(objective, model, call=None, steps=3):
    """Losses, info and accumulated parameter gradients of `steps` calls (``loss.backward()`` each), dropout on."""
    call = call or objective
    torch.manual_seed(0)
    out = []
    for step in range(steps):
        args = (PAIRS,) if objective.needs_pairs else ()
        loss, info = call(_batch(step), *args)
        loss.backward()
        out.append((loss.detach(), {k: v.detach().clone() for k, v in info.items()}))
    grads = {n: p.grad.clone() for n, p in models.unwrap(model).named_parameters() if p.grad is not None}
    return out, grads


def _assert_same(got, want):
    (steps_a, grads_a), (steps_b, grads_b) = got, want
    for (la, ia), (lb, ib) in zip(steps_a, steps_b):
        torch.testing.assert_close(la, lb, rtol=0, atol=1e-6)
        assert ia.keys() == ib.keys()
        for k in ia:
            torch.testing.assert_close(ia[k], ib[k], rtol=0, atol=1e-6, msg=k)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for n in grads_a:
        torch.testing.assert_close(grads_a[n], grads_b[n], rtol=0, atol=1e-6, msg=n)


def _compiled(model, how, backend="eager"):
    """`model` compiled `how` ("wrapper": torch.compile(model); "in-place": model.compile()), its graph traced by
    one training forward (as a user's step would), so that hooks added later are not in it."""
    if how == "wrapper":
        compiled = torch.compile(model, backend=backend)
    else:
        model.compile(backend=backend)
        compiled = model
    compiled(**models.model_inputs(_batch(9))).logits.sum().backward()
    model.zero_grad(set_to_none=True)
    return compiled


def _fresh_counter():
    """A backend counting the graphs dynamo compiles, dynamo's caches cleared first: its recompilation limit counts
    the graphs of a code object (Bert's forward) over the session's models, and past it dynamo runs the code
    uncompiled (no graph to count)."""
    torch.compiler.reset()
    return CompileCounter()


def _hooks_and_patches(model):
    return [(name, len(m._forward_hooks), len(m._forward_pre_hooks), "forward" in m.__dict__)
            for name, m in model.named_modules()]


@pytest.mark.parametrize("how", ["wrapper", "in-place"])
@pytest.mark.parametrize("name", OBJECTIVES)
def test_compiled_model_gives_the_uncompiled_losses_and_gradients(name, how):
    """The same losses, info and gradients as the uncompiled model (same seeds, dropout on), the objective on the
    original module, and no hook or patched forward left on it."""
    want_model = tiny_model("bert").train()
    want = _steps(_objective(name, want_model), want_model)
    model = tiny_model("bert").train()
    before = _hooks_and_patches(model)
    compiled = _compiled(model, how)
    objective = _objective(name, compiled)
    assert objective.model is model
    assert objective.compiled_model is (compiled if how == "wrapper" else None)
    _assert_same(_steps(objective, compiled), want)
    assert _hooks_and_patches(model) == before


@pytest.mark.parametrize("how", ["wrapper", "in-place"])
def test_compiled_model_runs_its_graph_as_before_after_the_objectives(how):
    """CAT, GS and PoE steps leave no hook, patched forward or set-aside compiled call behind; the compiled model
    then runs the graph it had (no recompilation) and gives the values it gave."""
    counter = _fresh_counter()
    model = tiny_model("bert").eval()
    inputs = models.model_inputs(_batch(0))
    compiled = torch.compile(model, backend=counter) if how == "wrapper" else model
    if how == "in-place":
        model.compile(backend=counter)
    call_impl = model.__dict__.get("_compiled_call_impl")
    with torch.no_grad():
        want = compiled(**inputs).logits
    frames = counter.frame_count
    before = _hooks_and_patches(model)
    for name in ("cat", "gs-first-order", "poe"):
        objective = _objective(name, compiled)
        model.train()
        _steps(objective, compiled, steps=2)
        model.eval()
    assert _hooks_and_patches(model) == before
    assert model.__dict__.get("_compiled_call_impl") is call_impl
    with torch.no_grad():
        got = compiled(**inputs).logits
    assert counter.frame_count == frames  # the objectives' passes never ran (nor traced) the compiled graph
    assert torch.equal(got, want)


def test_erm_runs_the_compiled_graph():
    counter = _fresh_counter()
    model = tiny_model("bert").train()
    compiled = torch.compile(model, backend=counter)
    _steps(ERM(compiled), compiled, steps=2)
    assert counter.frame_count >= 1  # ERM's plain forward is the compiled model's


def test_a_failing_pass_restores_the_compiled_call():
    model = tiny_model("bert")
    compiled = _compiled(model, "in-place")
    call_impl = model._compiled_call_impl
    before = _hooks_and_patches(model)
    batch = _batch(0)
    batch["input_ids"] = batch["input_ids"] + 1000  # out of the vocabulary: the embedding lookup raises
    with pytest.raises(IndexError):
        models.capture(compiled, batch, 2)
    assert model._compiled_call_impl is call_impl and _hooks_and_patches(model) == before
    with pytest.raises(RuntimeError, match="inside"):
        with models.uncompiled(model) as module:
            assert module is model and model._compiled_call_impl is None
            raise RuntimeError("inside")
    assert model._compiled_call_impl is call_impl
    wrapper = torch.compile(model, backend="eager")
    with models.uncompiled(wrapper) as module:
        assert module is model and model._compiled_call_impl is None
    assert model._compiled_call_impl is call_impl


def test_unwrap_orig_module_and_compiled_wrapper():
    model = tiny_model("bert").eval()
    wrapper = torch.compile(model, backend="eager")
    assert models.unwrap(wrapper) is model and models.compiled_wrapper(wrapper) is wrapper
    assert models.compiled_wrapper(model) is None and models.is_compiled(wrapper) and not models.is_compiled(model)
    assert models.orig_module(wrapper) is model and models.orig_module(model) is model
    other = torch.nn.Sequential(model)  # any other module is kept as it is
    assert models.orig_module(other) is other
    model.train()  # the wrapper's own flag stays False: the passes read the model's
    cap = models.capture(wrapper, _batch(0), 1)
    assert cap.training and cap.rng_state is not None
    model.compile(backend="eager")
    assert models.unwrap(model) is model and models.is_compiled(model) and models.compiled_wrapper(model) is None
    assert models.structure(wrapper) is models.structure(model)


def test_compiled_submodules_and_interventions_on_a_compiled_model_are_refused():
    model = tiny_model("bert")
    model.bert.encoder.layer[1].compile(backend="eager")
    with pytest.raises(ValueError, match=r"submodule 'bert.encoder.layer.1' is compiled .*compile the whole model"):
        CAT(model)
    regional = tiny_model("bert")  # accelerate's regional compilation: torch.compile wrappers in the layer list
    regional.bert.encoder.layer[0] = torch.compile(regional.bert.encoder.layer[0], backend="eager")
    with pytest.raises(ValueError, match=r"submodule 'bert.encoder.layer.0' is compiled"):
        GradientSupervision(regional)
    for compiled in (torch.compile(tiny_model("bert"), backend="eager"), _compiled(tiny_model("bert"), "in-place")):
        with pytest.raises(ValueError, match="it is compiled .*interventions are forward hooks"):
            models.intervene(compiled, 1, "intermediate", lambda x: x)


def test_cat_on_an_inductor_compiled_model_is_exact():
    """The default backend (inductor): CAT's passes never run its graph, so CAT's values are the uncompiled
    model's exactly, while the compiled model itself runs inductor's graph (values within rounding)."""
    want_model = tiny_model("bert").train()
    want = _steps(_objective("cat", want_model), want_model, steps=2)
    model = tiny_model("bert").eval()
    compiled = torch.compile(model)
    inputs = models.model_inputs(_batch(0))
    with torch.no_grad():
        torch.testing.assert_close(compiled(**inputs).logits, tiny_model("bert").eval()(**inputs).logits,
                                   rtol=1e-5, atol=1e-5)
    model.train()
    _assert_same(_steps(_objective("cat", compiled), compiled, steps=2), want)


# ----------------------------------------------------------------------------- DDP (one process, gloo)

@pytest.fixture
def process_group(tmp_path):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("how", ["ddp(compiled)", "compiled(ddp)", "ddp(in-place)"])
@pytest.mark.parametrize("name", ["cat", "gs-first-order-ddp", "erm"])
def test_compiled_models_under_ddp(process_group, name, how):
    """DDP(torch.compile(model)), torch.compile(DDP(model)) (what accelerate makes) and DDP of a model compiled in
    place: the objective runs inside DDP's forward on the original model, with the uncompiled DDP run's values; the
    forward and compiled call that `run_in_forward` set aside are back afterwards."""
    want_model = tiny_model("bert").train()
    ddp = DDP(want_model)
    want_objective = _objective(name, ddp)
    want = _steps(want_objective, want_model, call=D.DistributedObjective(want_objective, ddp))
    model = tiny_model("bert").train()
    if how == "ddp(compiled)":
        wrapped = DDP(torch.compile(model, backend="eager"))
    elif how == "compiled(ddp)":
        wrapped = torch.compile(DDP(model), backend="eager")
    else:
        model.compile(backend="eager")
        wrapped = DDP(model)
    inner = models.orig_module(wrapped).module
    forward, call_impl = inner.__dict__.get("forward"), model.__dict__.get("_compiled_call_impl")
    objective = _objective(name, wrapped)
    call = D.DistributedObjective(objective, wrapped)
    assert objective.model is model and call.model is model
    _assert_same(_steps(objective, wrapped, call=call), want)
    assert inner.__dict__.get("forward") is forward and model.__dict__.get("_compiled_call_impl") is call_impl
    assert all("forward" not in m.__dict__ for m in model.modules())
