"""cat_fast.GradientSupervision: the GS term reaches the parameters, is exact, first-order agrees, sdpa message."""
import pytest
import torch
import torch.nn.functional as F

from cat_fast import models
from cat_fast.objectives import DOUBLE_BACKWARD_HINT, GradientSupervision, double_backward_error, pair_by_group
from tests.conftest import tiny_batch, tiny_model

PAIRS = torch.tensor([1, 0, 3, 2])
LABELS = torch.tensor([0, 1, 2, 0])


def batch_f(arch="bert", **kw):
    b = tiny_batch(arch, **kw)
    b["labels"] = LABELS.clone()
    return b


def param_grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)])


@pytest.mark.parametrize("representation", ["pooled", "layer:1", 0])
def test_gs_term_reaches_the_parameters_and_changes_the_gradient(representation):
    model = tiny_model("bert").eval()
    batch = batch_f()
    loss, info = GradientSupervision(model, representation=representation)(batch, PAIRS)
    gs_only = loss - F.cross_entropy(model(**models.model_inputs(batch)).logits, LABELS)
    g_gs = param_grads(model, gs_only)
    assert g_gs.abs().max() > 1e-6  # ∂L_GS/∂θ ≠ 0 (a detached g would give exactly 0)
    ce_only, _ = GradientSupervision(model, weight=0.0, representation=representation)(batch, PAIRS)
    assert (param_grads(model, loss) - param_grads(model, ce_only)).abs().max() > 1e-6
    assert float(info["gs_pairs"]) == 4.0 and 0.0 < float(info["gs_loss"]) < 2.0


def test_exact_gs_gradient_matches_finite_differences_float64():
    model = tiny_model("bert", dtype=torch.float64).eval()
    batch = batch_f()
    gs = GradientSupervision(model, weight=5.0, representation="layer:1")
    w = model.bert.encoder.layer[1].attention.self.query.weight
    loss, _ = gs(batch, PAIRS)
    (grad,) = torch.autograd.grad(loss, w)
    h = 1e-6
    for idx in [(0, 0), (3, 7), (17, 2)]:
        with torch.no_grad():
            w[idx] += h
            up = gs(batch, PAIRS)[0].item()
            w[idx] -= 2 * h
            down = gs(batch, PAIRS)[0].item()
            w[idx] += h
        fd = (up - down) / (2 * h)
        assert abs(fd - grad[idx].item()) <= 1e-6 + 1e-4 * abs(fd), (idx, fd, grad[idx].item())


def backward_grads(model, loss):
    """Parameter gradients of `loss` by loss.backward() (.grad): what low-memory first-order GS needs."""
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in params])
    model.zero_grad(set_to_none=True)
    return grads


FIRST_ORDER = [dict(difference="central", low_memory=True), dict(difference="central", low_memory=False),
               dict(difference="forward", low_memory=True), dict(difference="forward", low_memory=False)]
FIRST_ORDER_IDS = ["central-low-memory", "central-graph", "forward-low-memory", "forward-graph"]


@pytest.mark.parametrize("first_order", FIRST_ORDER, ids=FIRST_ORDER_IDS)
@pytest.mark.parametrize("representation", ["pooled", "layer:2"])
@pytest.mark.parametrize("target", ["counterfactual", "factual"])
def test_first_order_agrees_with_exact_float64(representation, target, first_order):
    model = tiny_model("bert", dtype=torch.float64).eval()
    batch = batch_f()
    kw = dict(weight=1.0, representation=representation, target=target)
    exact, info_e = GradientSupervision(model, mode="exact", **kw)(batch, PAIRS)
    first, info_f = GradientSupervision(model, mode="first_order", **first_order, **kw)(batch, PAIRS)
    torch.testing.assert_close(first, exact)  # the reported value is the true loss
    def ce():
        return F.cross_entropy(model(**models.model_inputs(batch)).logits, LABELS)

    ge, gf = backward_grads(model, exact - ce()), backward_grads(model, first - ce())
    assert ge.abs().max() > 1e-6
    assert F.cosine_similarity(ge, gf, dim=0) > 0.999
    torch.testing.assert_close(gf, ge, rtol=0, atol=2e-2 * float(ge.abs().max()))


@pytest.mark.parametrize("representation", ["pooled", "layer:1", 0])
@pytest.mark.parametrize("difference", ["central", "forward"])
def test_low_memory_first_order_equals_the_graph_version(representation, difference):
    # Same gradient, whether the perturbed passes run in the caller's backward (low_memory) or as graphs.
    model = tiny_model("bert", dtype=torch.float64, hidden_dropout_prob=0.2).train()
    batch = batch_f()
    grads = []
    for low_memory in (True, False):
        torch.manual_seed(0)
        gs = GradientSupervision(model, weight=3.0, representation=representation, mode="first_order",
                                 difference=difference, low_memory=low_memory)
        loss, _ = gs(batch, PAIRS)
        grads.append(backward_grads(model, 2.0 * loss))  # a loss scale (GradScaler) reaches the deferred passes
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-12)


def test_first_order_keeps_dropout_masks_in_train_mode():
    model = tiny_model("bert", dtype=torch.float64, hidden_dropout_prob=0.2).train()
    batch = batch_f()
    torch.manual_seed(0)  # exact mode runs the full last layer: first_order too, to draw the same masks
    exact, _ = GradientSupervision(model, representation="layer:1")(batch, PAIRS)
    ge = backward_grads(model, exact)
    torch.manual_seed(0)
    first, _ = GradientSupervision(model, representation="layer:1", mode="first_order",
                                   prune_last_layer=False)(batch, PAIRS)
    gf = backward_grads(model, first)
    assert F.cosine_similarity(ge, gf, dim=0) > 0.99


def test_first_order_arguments_are_checked():
    model = tiny_model("bert")
    with pytest.raises(ValueError, match="difference"):
        GradientSupervision(model, mode="first_order", difference="backward")


def test_same_label_and_missing_pairs_are_skipped():
    model = tiny_model("bert").eval()
    batch = batch_f()
    loss, info = GradientSupervision(model)(batch, torch.tensor([3, -1, -1, 0]))  # 0 and 3 share label 0
    assert float(info["gs_pairs"]) == 0.0 and float(info["gs_loss"]) == 0.0
    torch.testing.assert_close(loss, info["ce_loss"])


def test_random_pairs_pick_other_samples_reproducibly():
    model = tiny_model("bert").eval()
    batch = batch_f(batch=4)
    a = GradientSupervision(model, random_pairs=True, generator=torch.Generator().manual_seed(0))(batch)[0]
    b = GradientSupervision(model, random_pairs=True, generator=torch.Generator().manual_seed(0))(batch)[0]
    torch.testing.assert_close(a, b)
    from cat_fast.objectives.gs import _random_pairs

    p = _random_pairs(50, torch.device("cpu"), torch.Generator().manual_seed(1))
    assert (p != torch.arange(50)).all() and p.min() >= 0 and p.max() < 50


def test_factual_target_differs_from_counterfactual():
    model = tiny_model("bert").eval()
    batch = batch_f()
    a = GradientSupervision(model, target="counterfactual")(batch, PAIRS)[1]["gs_loss"]
    b = GradientSupervision(model, target="factual")(batch, PAIRS)[1]["gs_loss"]
    assert float(a) != float(b)


def test_pair_by_group():
    got = pair_by_group(torch.tensor([5, 7, 5, 9, 7, 5]))
    assert got.tolist() == [2, 4, 5, -1, 1, 0]


def test_exact_mode_on_sdpa_without_double_backward_raises_the_fix():
    model = tiny_model("bert", attn="sdpa").eval()
    batch = batch_f(padded=False)  # no padding: CPU sdpa takes its flash kernel (no double backward)
    with pytest.raises(RuntimeError) as err:
        GradientSupervision(model, representation="layer:0")(batch, PAIRS)
    msg = str(err.value)
    assert msg == DOUBLE_BACKWARD_HINT and "\n" not in msg
    assert 'attn_implementation="eager"' in msg and "SDPBackend.MATH" in msg and "first_order" in msg
    loss, _ = GradientSupervision(model, representation="layer:0", mode="first_order")(batch, PAIRS)
    loss.backward()  # first order needs no double backward
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        loss, _ = GradientSupervision(model, representation="layer:0")(batch, PAIRS)
    loss.backward()


def test_double_backward_error_message_mapping():
    exc = RuntimeError("derivative for aten::_scaled_dot_product_efficient_attention_backward is not implemented")
    mapped = double_backward_error(exc)
    assert isinstance(mapped, RuntimeError) and str(mapped) == DOUBLE_BACKWARD_HINT
    assert double_backward_error(RuntimeError("CUDA out of memory")) is None


@pytest.mark.parametrize("representation", ["pooled", 0])
def test_low_memory_first_order_frees_the_step_without_the_garbage_collector(representation):
    # The deferred passes hang a hook on the clean graph; nothing of the step may stay alive in a cycle.
    import gc
    import weakref

    model = tiny_model("bert").train()
    gs = GradientSupervision(model, representation=representation, mode="first_order")
    seen = []
    handle = model.bert.encoder.layer[0].register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(weakref.ref(args[0] if args else kwargs["hidden_states"])),
        with_kwargs=True)
    gc.disable()
    try:
        loss, info = gs(batch_f(), PAIRS)
        loss.backward()
        del loss, info
        assert seen and all(ref() is None for ref in seen)
    finally:
        gc.enable()
        handle.remove()


@pytest.mark.parametrize("target", ["counterfactual", "factual"])
@pytest.mark.parametrize("arch, closed", [("bert", True), ("roberta", False)])
def test_pooled_exact_closed_form_gradient_equals_autograd(arch, closed, target):
    # A linear head on the pooled vector gets g in closed form (no autograd double backward); same loss, same grads.
    # "second call": after the first call has checked the closed form, g and the row weights are computed before
    # the forward (counterfactual target) and the loss by one composite cosine.
    model = tiny_model(arch, dtype=torch.float64).train()
    batch = batch_f(arch)
    results = []
    for closed_form in (None, False, "second call"):
        gs = GradientSupervision(model, weight=2.0, target=target)
        if closed_form == "second call":
            gs(batch, PAIRS)
            assert gs._pooled_dtype == torch.float64
            early = gs._pooled_closed_form(LABELS[PAIRS], LABELS[PAIRS] != LABELS)
            assert (early is not None) is (closed and target == "counterfactual")
        else:
            gs._closed_form = closed_form
        torch.manual_seed(0)
        loss, info = gs(batch, PAIRS)
        assert bool(gs._closed_form) is (closed and closed_form != False)  # noqa: E712
        assert float(info["gs_pairs"]) == 4.0
        results.append((loss.detach(), backward_grads(model, loss)))
    for loss, grads in results[1:]:
        torch.testing.assert_close(results[0][0], loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(results[0][1], grads, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("representation", ["pooled", 0])
def test_gs_under_bf16_autocast(representation):
    model = tiny_model("bert", attn="eager").train()
    gs = GradientSupervision(model, representation=representation)
    for _ in range(2):  # pooled: the second call takes the closed form computed before the forward
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, info = gs(batch_f(), PAIRS)
        loss.backward()
        assert torch.isfinite(loss) and float(info["gs_pairs"]) == 4.0
    assert gs._closed_form is (True if representation == "pooled" else None)
    if representation == "pooled":
        assert gs._pooled_dtype == torch.bfloat16
        model.zero_grad()
        losses, grads = [], []
        for closed_form in (True, False):
            gs._closed_form = closed_form
            torch.manual_seed(0)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _ = gs(batch_f(), PAIRS)
            losses.append(loss.detach())
            grads.append(backward_grads(model, loss))
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads[0], grads[1], rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("arch", ["bert", "distilbert"])
@pytest.mark.parametrize("representation, mode", [("pooled", "exact"), ("pooled", "first_order"),
                                                  ("layer:1", "first_order"), (0, "first_order")])
def test_pruned_last_layer_gives_the_same_loss_and_gradients(arch, representation, mode):
    # Every pass with the first-token last layer: the same loss and parameter gradients in float64.
    model = tiny_model(arch, dtype=torch.float64).eval()
    batch = batch_f(arch)
    results = []
    for prune in (True, False):
        gs = GradientSupervision(model, weight=2.0, representation=representation, mode=mode,
                                 prune_last_layer=prune)
        loss, info = gs(batch, PAIRS)
        results.append((loss.detach(), info, backward_grads(model, loss)))
    (loss_p, info_p, grad_p), (loss_f, info_f, grad_f) = results
    assert models.first_token_ready(model, batch)
    torch.testing.assert_close(loss_p, loss_f, rtol=1e-10, atol=1e-12)
    for key in info_f:
        torch.testing.assert_close(info_p[key], info_f[key], rtol=1e-10, atol=1e-12)
    assert grad_f.abs().max() > 1e-6
    torch.testing.assert_close(grad_p, grad_f, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("pairs, error, message", [
    (torch.tensor([1]), ValueError, r"pairs: expected shape \(4,\)"),
    (torch.tensor([1, 0, 3]), ValueError, r"pairs: expected shape \(4,\)"),
    (torch.tensor([1, 0, 3, 4]), ValueError, r"pairs: expected partner indices in \[-1, 4\)"),
    (torch.tensor([1, 0, -2, -1]), ValueError, r"pairs: expected partner indices in \[-1, 4\)"),
    (torch.tensor([1.0, 0.0, 3.0, 2.0]), TypeError, "pairs: expected an integer tensor"),
    ([1, 0, 3, 2], TypeError, "pairs: expected an integer torch.Tensor"),
])
def test_bad_pairs_are_clear_errors(pairs, error, message):
    model = tiny_model("bert", attn="eager").eval()
    batch = tiny_batch("bert", batch=4)
    gs = GradientSupervision(model)
    with pytest.raises(error, match=message):
        gs(batch, pairs)
    gs(batch, torch.tensor([1, 0, -1, 2], dtype=torch.int32))  # any integer dtype, -1 = none


def test_bad_hyper_parameters_name_the_argument():
    model = tiny_model("bert", attn="eager")
    with pytest.raises(ValueError, match=r"weight: expected a finite number in \[0, inf\)"):
        GradientSupervision(model, weight=-1.0)
    with pytest.raises(ValueError, match="eps: expected a finite number"):
        GradientSupervision(model, eps=float("nan"))
