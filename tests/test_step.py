"""`cat_fast.step.CapturedStep`: a whole training step replayed as a CUDA graph per batch signature (GPU), and the
same step run eagerly (CPU, ``cuda_graph=False``)."""
import warnings

import pytest
import torch

from cat_fast import step as step_module
from cat_fast.objectives import CAT, CLP, ERM, GradientSupervision, PoE
from cat_fast.step import CapturedStep, NotCapturable
from tests.conftest import tiny_batch, tiny_model

GPU = torch.cuda.is_available()


def _loop(model, objective, batches, lr=1e-3, max_grad_norm=1.0, captured=None, **step_kwargs):
    """Parameters after `batches` steps, either a plain eager loop or CapturedStep; losses per step."""
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    lr_value = torch.tensor(lr, device=device) if device.type == "cuda" else lr
    opt = torch.optim.AdamW(params, lr=lr_value, capturable=device.type == "cuda")
    losses = []
    if captured is None:
        for batch, args in batches:
            loss, _ = objective(batch, *args)
            loss.backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    else:
        step = CapturedStep(objective, opt, max_grad_norm=max_grad_norm, cuda_graph=captured, **step_kwargs)
        for batch, args in batches:
            loss, _ = step(batch, *args)
            losses.append(loss)
        objective.captured_step = step
    return {n: p.detach().clone() for n, p in model.named_parameters()}, torch.stack(losses)


def _batches(n, device, pairs=False, bias=False, length=9):
    out = []
    for i in range(n):
        b = {k: v.to(device) for k, v in tiny_batch("bert", batch=4, length=length, seed=i).items()}
        if bias:
            g = torch.Generator().manual_seed(50 + i)
            b["bias"] = torch.randn(4, 3, generator=g).log_softmax(-1).to(device)
        out.append((b, (torch.tensor([1, 0, 3, 2], device=device),) if pairs else ()))
    return out


def test_eager_step_equals_a_plain_loop():
    """cuda_graph=False (and any CPU model): the step is the loop's: loss, backward, clipping, AdamW."""
    for make in (lambda m: ERM(m), lambda m: PoE(m)):
        bias = isinstance(make(tiny_model("bert")), PoE)
        batches = _batches(4, "cpu", bias=bias)
        torch.manual_seed(0)
        model = tiny_model("bert", seed=1)
        want, want_losses = _loop(model, make(model), batches)
        torch.manual_seed(0)
        model = tiny_model("bert", seed=1)
        objective = make(model)
        got, got_losses = _loop(model, objective, batches, captured=False)
        step = objective.captured_step
        assert step.num_graphs == step.num_packed_graphs == step.num_replays == 0  # every step eager
        torch.testing.assert_close(got_losses, want_losses, rtol=0, atol=0)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=n)


def test_bad_arguments_name_themselves():
    model = tiny_model("bert")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for kwargs, match in ((dict(max_grad_norm=0), "max_grad_norm"), (dict(autocast=torch.float32), "autocast"),
                          (dict(warmup_steps=0), "warmup_steps"), (dict(max_graphs=-1), "max_graphs"),
                          (dict(share_rows=1.5), "share_rows"), (dict(share_rows=True), "share_rows")):
        with pytest.raises(ValueError, match=match):
            CapturedStep(ERM(model), opt, cuda_graph=False, **kwargs)
    CapturedStep(ERM(model), opt)  # a CPU model: every step runs eagerly, any optimizer will do


def test_a_shared_graph_covers_every_count_within_the_slack():
    """`step.shared_graph`: of the captured graphs, the one whose counts are each at least the step's, the fewest
    rows more in all, within ``slack * total``; a count below the step's, another number of counts or too many more
    rows: none."""
    graphs = [("a", 120), ("b", 100), ("c", 140)]
    assert step_module.shared_graph(graphs, 100, 1000, 0.125) == ("b", 100)  # its own count: no extra rows
    assert step_module.shared_graph(graphs, 101, 1000, 0.125) == ("a", 120)
    assert step_module.shared_graph(graphs, 101, 1000, 0.01) is None  # 19 rows more > 10
    assert step_module.shared_graph(graphs, 141, 1000, 1.0) is None  # no graph has as many
    triples = [("t", (120, 100, 30)), ("u", (110, 110, 20)), ("p", (130, 100))]
    assert step_module.shared_graph(triples, (105, 100, 20), 1000, 0.125) == ("u", (110, 110, 20))
    assert step_module.shared_graph(triples, (105, 100, 25), 1000, 0.125) == ("t", (120, 100, 30))
    assert step_module.shared_graph(triples, (105, 100, 25), 1000, 0.02) == ("t", (120, 100, 30))  # 20 more: at most
    assert step_module.shared_graph(triples, (105, 100, 25), 1000, 0.019) is None
    assert step_module.shared_graph(triples, (100, 100), 1000, 0.125) == ("p", (130, 100))
    assert step_module.shared_graph([], 10, 1000, 1.0) is None


@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_gpu_an_optimizer_that_is_not_capturable_is_refused():
    model = tiny_model("bert").cuda()
    with pytest.raises(ValueError, match="capturable=True"):
        CapturedStep(ERM(model), torch.optim.AdamW(model.parameters(), lr=1e-3))
    CapturedStep(ERM(model), torch.optim.AdamW(model.parameters(), lr=1e-3), cuda_graph=False)


def test_objectives_say_whether_a_step_can_be_replayed():
    model = tiny_model("bert")
    batch = tiny_batch("bert", batch=4)
    assert ERM(model).capture_key(batch) == ()
    assert ERM(model).plan_step(batch).key == ()
    for objective, reason in ((CAT(model, update="alternate"), "alternate"),
                              (ERM(model, two_step=True), "inner optimizer step"),
                              (GradientSupervision(model, mode="first_order"), "low_memory=True")):
        with pytest.raises(NotCapturable, match=reason):
            objective.plan_step(batch)
        assert objective.step == 0  # a refused plan advances nothing
    gs = GradientSupervision(model, random_pairs=True, generator=torch.Generator().manual_seed(0))
    plans = [gs.plan_step(batch) for _ in range(3)]
    assert all(p.key == ("gs",) and p.state is None for p in plans)  # a CPU model: no pass generators
    drawn = [p.tensors["pairs"] for p in plans]
    assert all(((d - torch.arange(4)) % 4 != 0).all() for d in drawn)  # a partner other than the row itself
    assert not all(torch.equal(drawn[0], d) for d in drawn[1:])  # drawn anew each step


def test_cat_plans_warm_up_then_its_drawn_layer():
    model = tiny_model("bert")
    batch = tiny_batch("bert", batch=4)
    cat = CAT(model, layers=[1, 2], warmup_steps=2, generator=torch.Generator().manual_seed(0))
    plans = [cat.plan_step(batch) for _ in range(6)]
    assert [p.key for p in plans[:2]] == [("erm",), ("erm",)] and cat.step == 6
    assert {p.key for p in plans[2:]} <= {("cat", 1), ("cat", 2)}
    for p in plans[2:]:
        assert p.state[0] == p.key[1] and p.state[1] is None  # a CPU model: no pass generators
        assert p.tensors["partner"].shape == (4,) and p.tensors["lam0"].shape == (4,)
        assert sorted(p.tensors["partner"].tolist()) == [0, 1, 2, 3]  # a permutation
    with pytest.raises(TypeError, match="plan_step"):
        cat.capture_key(batch)


@pytest.mark.parametrize("generator,gs_weight", [(None, 0.0), (3, 0.0), (3, 1.0)])
def test_planned_cat_steps_equal_its_own_calls(generator, gs_weight):
    """CapturedStep runs CAT through plan_step + planned_step (CPU: eagerly): the same draws (layer, partners, λ,
    dropout), losses and parameters as the loop calling CAT itself, warm-up steps included."""
    batches = _batches(6, "cpu")
    runs = []
    for captured in (None, False):
        torch.manual_seed(0)
        model = tiny_model("bert", seed=1).train()
        gen = torch.Generator().manual_seed(generator) if generator is not None else None
        cat = CAT(model, layers=[1, 2, 3], warmup_steps=2, generator=gen, gs_weight=gs_weight)
        runs.append(_loop(model, cat, batches, captured=captured))
    (want, want_losses), (got, got_losses) = runs
    assert want_losses[2:].ne(want_losses[2:].roll(1)).all()  # the CAT steps differ from each other
    torch.testing.assert_close(got_losses, want_losses, rtol=0, atol=0)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("kwargs", [dict(random_pairs=True, generator=5), dict(random_pairs=True),
                                    dict(mode="first_order", low_memory=False),
                                    dict(mode="first_order", low_memory=False, difference="forward", representation=0)])
def test_planned_gs_steps_equal_its_own_calls(kwargs):
    """GS through plan_step + planned_step (CPU: eagerly) equals the loop calling GS itself: random pairs drawn as
    the call draws them; first-order passes with the clean forward's dropout."""
    batches = _batches(4, "cpu", pairs=not kwargs.get("random_pairs"))
    runs = []
    for captured in (None, False):
        torch.manual_seed(0)
        model = tiny_model("bert", seed=1).train()
        kw = dict(kwargs)
        if "generator" in kw:
            kw["generator"] = torch.Generator().manual_seed(kw["generator"])
        runs.append(_loop(model, GradientSupervision(model, **kw), batches, captured=captured))
    (want, want_losses), (got, got_losses) = runs
    torch.testing.assert_close(got_losses, want_losses, rtol=0, atol=0)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("virtual", ["head", "all"])
def test_planned_clp_steps_equal_its_own_calls(virtual):
    """CLP through plan_step + planned_step (CPU: eagerly) equals the loop calling CLP itself: the metadata batches
    in turn, the class statistics across an epoch's end (epoch_size 8: the second step ends the first epoch), Ω's
    own Adam step, and the state after."""
    batches = _batches(5, "cpu")
    meta = [b for b, _ in _batches(2, "cpu")]
    runs, states = [], []
    for captured in (None, False):
        torch.manual_seed(0)
        model = tiny_model("bert", seed=1).train()
        clp = CLP(model, meta, virtual=virtual, virtual_lr=0.1, epoch_size=8)
        runs.append(_loop(model, clp, batches, captured=captured))
        states.append(clp.state_dict())
    (want, want_losses), (got, got_losses) = runs
    torch.testing.assert_close(got_losses, want_losses, rtol=0, atol=0)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=n)
    assert states[0]["last"] is not None and states[0]["seen"] == states[1]["seen"] == 4
    torch.testing.assert_close(states[1]["last"], states[0]["last"], rtol=0, atol=0)
    torch.testing.assert_close(states[1]["sums"], states[0]["sums"], rtol=0, atol=0)
    for k, v in states[0]["omega"].items():
        torch.testing.assert_close(states[1]["omega"][k], v, rtol=0, atol=0, msg=k)


def test_clp_plans_the_epoch_end_and_refuses_ddp():
    model = tiny_model("bert")
    batch = tiny_batch("bert", batch=4)
    clp = CLP(model, [batch], virtual_lr=0.1, epoch_size=8)
    keys = [clp.plan_step(batch).key for _ in range(3)]
    assert keys == [("clp", False, False), ("clp", False, True), ("clp", True, False)] and clp.step == 3
    clp.distributed = True
    with pytest.raises(NotCapturable, match="DistributedDataParallel"):
        clp.plan_step(batch)


# ----------------------------------------------------------------------------- GPU

@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("name", ["erm", "erm-fast", "poe", "gs-pooled", "gs-first-order", "gs-first-order-pooled", "gs-random",
                                  "gs-exact-layer", "clp"])
def test_gpu_replayed_steps_equal_the_eager_loop(name):
    """Eight steps with dropout (3 eager warm-up steps, the capture, replays): the same parameters and losses as
    the eager loop with the same seed, and the signature captured once (a failed capture fails the test). The
    first-order cases check that the perturbed passes inside the graph redraw each step's clean-forward masks
    (`models.PassGenerators`), at layer 0 and at the pooled vector (the head's dropout); exact GS at layer 0 runs
    the twice-differentiable fused attention, whose dropout keep masks the graph redraws each replay."""
    make = {"erm": lambda m: ERM(m), "erm-fast": lambda m: ERM(m, fast=True), "poe": lambda m: PoE(m),
            "gs-pooled": lambda m: GradientSupervision(m, representation="pooled"),
            "gs-first-order": lambda m: GradientSupervision(m, mode="first_order", low_memory=False),
            "gs-first-order-pooled": lambda m: GradientSupervision(m, mode="first_order", low_memory=False,
                                                                   representation="pooled"),
            "gs-exact-layer": lambda m: GradientSupervision(m, representation=0),
            "gs-random": lambda m: GradientSupervision(m, random_pairs=True,
                                                       generator=torch.Generator().manual_seed(2)),
            "clp": lambda m: CLP(m, [b for b, _ in _batches(2, "cuda", length=9)], virtual_lr=0.1, epoch_size=12),
            }[name]
    batches = _batches(8, "cuda", pairs=name.startswith("gs") and name != "gs-random", bias=name == "poe")
    runs = []
    for captured in (None, True):
        model = tiny_model("bert", seed=1, attn="sdpa").cuda().train()
        torch.manual_seed(0)
        objective = make(model)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            runs.append(_loop(model, objective, batches, captured=captured))
        if captured:
            assert objective.captured_step.num_graphs == 1
            if name in ("erm", "erm-fast", "poe"):  # the default plan: replays count in the step counter
                assert objective.step == len(batches)
    (want, want_losses), (got, got_losses) = runs
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-6, atol=1e-6)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("name", ["erm-fast", "cat"])
def test_gpu_the_update_during_the_backward_changes_no_number(name, monkeypatch):
    """``step.OVERLAP_UPDATE``: the optimizer stepped group by group during the backward, on a stream of its own
    (`step_updates.BackwardUpdates`), eager warm-up steps, captures and replays with dropout under bf16 autocast
    give bit for bit the losses and parameters of the steps with the update after the backward, and groups were
    stepped during the backward."""
    batches = _batches(8, "cuda")
    runs, launched = {}, {}
    for on in (False, True):
        monkeypatch.setattr(step_module, "OVERLAP_UPDATE", on)
        model = tiny_model("bert", seed=1, attn="sdpa").cuda().train()
        torch.manual_seed(0)
        objective = (ERM(model, fast=True) if name == "erm-fast"
                     else CAT(model, layers=[1, 2], generator=torch.Generator().manual_seed(3)))
        runs[on] = _loop(model, objective, batches, max_grad_norm=None, captured=True, autocast=torch.bfloat16)
        updates = getattr(objective.captured_step, "_updates", None)
        launched[on] = updates.launched if updates is not None else 0
        assert objective.captured_step.num_replays >= 2
    (want, want_losses), (got, got_losses) = runs[False], runs[True]
    assert launched[False] == 0 and launched[True] >= 2
    assert torch.equal(got_losses, want_losses)
    for n in want:
        assert torch.equal(got[n], want[n]), n


@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("generator,gs_weight", [(None, 0.0), (3, 0.0), (3, 1.0)])
def test_gpu_replayed_cat_steps_equal_the_eager_loop(generator, gs_weight):
    """CAT as one CUDA graph per (mixing layer, shapes), with dropout: the counterfactual passes inside the graph
    must redraw each step's clean-forward masks (`models.PassGenerators`), not the masks of the captured step. Ten
    steps (warm-up ERM steps, two mixing layers, captures and replays): the same losses and parameters as CAT's own
    eager loop with the same seeds, one graph per key seen, and no capture failure."""
    batches = _batches(10, "cuda")
    runs = []
    for captured in (None, True):
        # CAT + GS differentiates g through layers m+1..L twice: eager attention
        model = tiny_model("bert", seed=1, attn="eager" if gs_weight else "sdpa").cuda().train()
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(generator) if generator is not None else None
        cat = CAT(model, layers=[1, 2], warmup_steps=1, generator=gen, gs_weight=gs_weight)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            runs.append(_loop(model, cat, batches, captured=captured, warmup_steps=1))
        if captured:
            assert cat.captured_step.num_graphs == len(cat.captured_step.cache.entries) >= 2
    (want, want_losses), (got, got_losses) = runs
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-6, atol=1e-6)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_gpu_replayed_cat_steps_with_the_kernels_own_dropout_equal_the_eager_loop(monkeypatch):
    """bf16 autocast with the fused training and resumed layers at any row count, so that the hidden dropouts are
    drawn in the residual LayerNorm kernel (`layers.training.OWN_DROPOUT`): the captured CAT steps' counterfactual
    passes redraw each step's clean-forward masks as the eager loop does (the same losses and parameters), and the
    kernel drew them."""
    from cat_fast.kernels.triton import residual_layer_norm
    from cat_fast.layers import training

    monkeypatch.setattr(training, "FUSED_MIN_ROWS", 0)
    drawn = []
    real = residual_layer_norm.forward_with_dropout
    monkeypatch.setattr(residual_layer_norm, "forward_with_dropout", lambda *a, **k: drawn.append(1) or real(*a, **k))
    batches = _batches(10, "cuda")
    runs = []
    for captured in (None, True):
        model = tiny_model("bert", seed=1, attn="sdpa").cuda().train()
        torch.manual_seed(0)
        cat = CAT(model, layers=[1, 2], warmup_steps=1, generator=torch.Generator().manual_seed(3))
        drawn.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            if captured:
                runs.append(_loop(model, cat, batches, captured=True, warmup_steps=1, autocast=torch.bfloat16))
            else:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    runs.append(_loop(model, cat, batches))
        assert drawn  # eagerly every step; captured, the warm-up steps and the captures
    (want, want_losses), (got, got_losses) = runs
    assert torch.isfinite(want_losses).all()
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-6, atol=1e-6)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


def test_rng_offset_says_none_without_the_cuda_op():
    """Off a CUDA build (`ops.fused.rng_offset_available` False) `rng_offset` says None and a warm batch shape's new
    row count takes one eager step of its own where its plan's passes redraw the dropout; with the op, or for a plan
    without passes, `COUNT_WARMUP` (none)."""
    from cat_fast.ops import fused
    from cat_fast.step import StepPlan

    with_passes, without = StepPlan(key=("k",), before_replay=lambda: None), StepPlan(key=("k",))
    if not fused.rng_offset_available():
        assert fused.rng_offset(torch.Generator()) is None
        assert step_module._count_warmup(with_passes) == 1
    else:
        assert step_module._count_warmup(with_passes) == step_module.COUNT_WARMUP == 0
    assert step_module._count_warmup(without) == step_module.COUNT_WARMUP


@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_gpu_rng_offset_reads_the_offset_inside_a_capture():
    """`ops.fused.rng_offset` of the device generator: outside a capture its offset; inside one the offset within the
    graph, 0 at the capture's start. Around dropout calls of 7, 4,096 and 3,000,001 elements and a flash attention
    with dropout, the differences of the readings inside the capture equal those of the same calls run eagerly;
    reading draws nothing (a replay advances the generator by the last reading)."""
    import torch.nn.functional as F

    from cat_fast.ops.fused import rng_offset, rng_offset_available

    assert rng_offset_available()
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    xs = [torch.randn(n, device="cuda") for n in (7, 4096, 3_000_001)]
    q = torch.randn(2, 4, 33, 64, device="cuda", dtype=torch.bfloat16)

    def body():
        marks = [rng_offset(gen)]
        for x in xs:
            F.dropout(x, 0.1, training=True)
            marks.append(rng_offset(gen))
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
        marks.append(rng_offset(gen))
        return marks

    assert rng_offset(gen) == gen.get_offset()
    eager = body()
    assert eager[-1] == gen.get_offset() and all(b > a for a, b in zip(eager, eager[1:]))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        inside = body()
    assert inside[0] == 0
    assert [b - a for a, b in zip(inside, inside[1:])] == [b - a for a, b in zip(eager, eager[1:])]
    before = gen.get_offset()
    graph.replay()
    assert gen.get_offset() - before == inside[-1]


@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_gpu_a_cat_graph_does_not_replay_the_captured_dropout():
    """The failure that would be silent: replays of one CAT graph on the same batch, with the same layer, partners
    and λ (the CPU generator reset) and lr 0, differ only by their dropout draws; each must equal an eager step from
    the same CUDA generator state, and two replays must differ (fresh masks, not the captured step's)."""
    model = tiny_model("bert", seed=1, attn="sdpa").cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.0, device="cuda"), weight_decay=0.0,
                            capturable=True)
    cat = CAT(model, layers=[2], generator=torch.Generator().manual_seed(0))
    step = CapturedStep(cat, opt, warmup_steps=1)
    (batch, _), = _batches(1, "cuda")
    draws = cat.generator.get_state()
    step(batch)  # the eager warm-up
    replayed, eager = [], []
    for _ in range(3):  # captured at the first, then replayed
        cat.generator.set_state(draws)
        before = torch.cuda.get_rng_state()
        replayed.append(step(batch)[0])
        after = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(before)
        cat.generator.set_state(draws)
        eager.append(cat.planned_step(cat.plan_step(batch), batch)[0].detach())
        assert torch.equal(torch.cuda.get_rng_state(), after)  # the graph advanced the generator as the eager step
    assert step.num_graphs == 1
    torch.testing.assert_close(torch.stack(replayed), torch.stack(eager), rtol=1e-6, atol=1e-6)
    assert replayed[1] != replayed[2]


@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_gpu_a_changed_float_learning_rate_raises():
    model = tiny_model("bert", seed=1, attn="sdpa").cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    step = CapturedStep(ERM(model), opt, warmup_steps=1)
    batches = _batches(3, "cuda")
    step(*batches[0])
    step(*batches[1])  # captured here
    assert step.num_graphs == 1
    opt.param_groups[0]["lr"] = 5e-4
    with pytest.raises(ValueError, match="tensor lr"):
        step(*batches[2])


def _options(name):
    """The implementations of optimizer `name` on the CPU: the for-loop, foreach and (where it has one) fused."""
    options = [{"foreach": False}, {"foreach": True}]
    if name in ("SGD", "Adam", "AdamW", "Adagrad"):
        options.append({"fused": True})
    return options


@pytest.mark.parametrize("name", step_module._PER_PARAMETER)
def test_a_step_split_by_parameters_is_the_one_step(name):
    """What the update under DDP relies on (`CapturedStep._update`: the parameters averaged first stepped while the
    last bucket is exchanged, then those of the last bucket): for each optimizer `_splittable` names, in each of
    its implementations, a step of some parameters then a step of the others (each skipping those whose ``.grad`` is
    None) leaves the parameters and the state of one step over all of them, bit for bit, over three steps with
    momentum, weight decay and amsgrad or its kin where the optimizer has them."""
    extra = {"SGD": dict(momentum=0.9, nesterov=True, weight_decay=0.01), "Adam": dict(amsgrad=True),
             "AdamW": dict(amsgrad=True), "RMSprop": dict(momentum=0.5, centered=True),
             "NAdam": dict(decoupled_weight_decay=True, weight_decay=0.1), "RAdam": dict(weight_decay=0.1)}
    for options in _options(name):
        made = []
        for _ in range(2):
            params = [torch.nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(i)))
                      for i, shape in enumerate([(7, 3), (5,), (4, 4), (1,), (9,)])]
            made.append((params, getattr(torch.optim, name)(params, lr=0.05, **extra.get(name, {}), **options)))
        (whole, one), (split, two) = made
        assert step_module._splittable(two)
        for i in range(3):
            for a, b in zip(whole, split):
                a.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(100 * i + a.numel()))
                b.grad = a.grad.clone()
            one.step()
            late = split[1::2]
            held = [(p, p.grad) for p in late]
            for p in late:
                p.grad = None
            two.step()
            early = [(p, p.grad) for p in split if p.grad is not None]
            for p, grad in held:
                p.grad = grad
            for p, _ in early:
                p.grad = None
            two.step()
            for p, grad in early:
                p.grad = grad
        for a, b in zip(whole, split):
            assert torch.equal(a, b), (name, options)
            for key, value in one.state[a].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(two.state[b][key])), (name, options, key)
        assert any(not torch.equal(p, torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
                   for i, p in enumerate(whole))


def test_only_per_parameter_optimizers_without_hooks_are_split():
    """A subclass (whose step may couple parameters), LBFGS, and an optimizer with a step hook (which would run
    twice) take one step after the whole average."""
    params = [torch.nn.Parameter(torch.zeros(3))]

    class Coupled(torch.optim.AdamW):
        pass

    assert step_module._splittable(torch.optim.AdamW(params))
    assert not step_module._splittable(Coupled(params))
    assert not step_module._splittable(torch.optim.LBFGS(params))
    hooked = torch.optim.SGD(params, lr=0.1)
    hooked.register_step_post_hook(lambda *args: None)
    assert not step_module._splittable(hooked)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(lambda *args: None)
    try:
        assert not step_module._splittable(torch.optim.SGD(params, lr=0.1))
    finally:
        handle.remove()
