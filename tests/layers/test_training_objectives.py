"""cat_fast.training_layer in the training forwards: `models.first_token_forward`, GS and CAT steps with the
training layers give the loss, logits and parameter gradients of the model's own layers."""
import pytest
import torch
import torch.nn.functional as F

from cat_fast import models
from cat_fast.layers import training as training_layer
from cat_fast.objectives import CAT, GradientSupervision
from tests.conftest import assert_same_cat_steps, cat_steps_fast_and_own, tiny_batch, tiny_model
from tests.layers.test_training import BERT_LAYOUTS

CUDA = torch.cuda.is_available()


def _logits_and_grads(model, batch, training_layers, seed=5):
    torch.manual_seed(seed)
    out = models.first_token_forward(model, batch, training_layers=training_layers)
    loss = F.cross_entropy(out.logits, batch["labels"])
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    return out.logits, grads


@pytest.mark.parametrize("arch", BERT_LAYOUTS)
def test_first_token_forward_with_training_layers_matches_the_model(arch):
    model = tiny_model(arch, attn="sdpa", dtype=torch.float64, num_layers=3)
    model.train()
    batch = tiny_batch(arch)
    used = []
    real = training_layer._TrainingLayer.apply
    try:
        training_layer._TrainingLayer.apply = lambda *a: used.append(1) or real(*a)
        for _ in range(2):  # the first call records the layers' output format with the model's own layers
            used.clear()
            logits, grads = _logits_and_grads(model, batch, True)
    finally:
        training_layer._TrainingLayer.apply = real
    assert len(used) == 2  # layers 1 and 2; the last runs for the first token
    want_logits, want = _logits_and_grads(model, batch, False)
    torch.testing.assert_close(logits, want_logits, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _gs_loss_and_grads(model, batch, pairs, training_layers, **options):
    gs = GradientSupervision(model, training_layers=training_layers, **options)
    out = []
    for seed in (11, 12):  # pooled exact: the second call takes the closed-form path
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        loss, _ = gs(batch, pairs)
        loss.backward()  # the first-order passes run inside it (low_memory)
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    return out


@pytest.mark.parametrize("options", [dict(representation="pooled", mode="exact"),
                                     dict(representation="pooled", mode="first_order"),
                                     dict(representation=0, mode="first_order"),
                                     dict(representation=1, mode="first_order", difference="forward")],
                         ids=["pooled-exact", "pooled-first-order", "h0-first-order", "h1-first-order-forward"])
def test_gs_step_is_unchanged_by_training_layers(options, monkeypatch):
    calls = []
    original = training_layer._TrainingLayer.apply
    monkeypatch.setattr(training_layer._TrainingLayer, "apply", lambda *a: calls.append(1) or original(*a))
    model = tiny_model("bert", attn="sdpa", dtype=torch.float64, num_layers=3, hidden_dropout_prob=0.2,
                       attention_probs_dropout_prob=0.2)
    model.train()
    batch = tiny_batch("bert")
    pairs = torch.tensor([1, 0, 3, 2])
    batch["labels"] = torch.tensor([0, 1, 2, 0])
    _gs_loss_and_grads(model, batch, pairs, True, **options)  # the layers' output format recorded
    calls.clear()
    got = _gs_loss_and_grads(model, batch, pairs, True, **options)
    assert calls, "the training layer never ran"
    calls.clear()
    want = _gs_loss_and_grads(model, batch, pairs, False, **options)
    assert not calls
    for (loss, grads), (loss_want, grads_want) in zip(got, want):
        torch.testing.assert_close(loss, loss_want, rtol=1e-12, atol=1e-12)
        assert grads.keys() == grads_want.keys()
        for n in grads:
            torch.testing.assert_close(grads[n], grads_want[n], rtol=1e-9, atol=1e-12, msg=n)


@pytest.mark.parametrize("prune", [True, False])
def test_cat_step_is_unchanged_by_training_layers(prune, monkeypatch):
    # Train mode (dropout), float64, CAL steps on: loss, info and parameter gradients of three CAT steps with the
    # training layers in the clean forward equal those with the model's own layers.
    calls = []
    original = training_layer._TrainingLayer.apply
    monkeypatch.setattr(training_layer._TrainingLayer, "apply", lambda *a: calls.append(1) or original(*a))
    results = cat_steps_fast_and_own("training_layers", prune, calls, "the training layer")
    assert_same_cat_steps(*results)


def test_cat_with_gradient_supervision_keeps_the_models_layers(monkeypatch):
    calls = []
    original = training_layer._TrainingLayer.apply
    monkeypatch.setattr(training_layer._TrainingLayer, "apply", lambda *a: calls.append(1) or original(*a))
    model = tiny_model("bert", attn="sdpa", dtype=torch.float64, num_layers=3).train()
    assert training_layer.supported(models.structure(model).layer_modules[0])
    cat = CAT(model, layers=[1], adv_steps=1, gs_weight=0.5, generator=torch.Generator().manual_seed(5))
    for _ in range(2):
        loss, _ = cat(tiny_batch("bert", batch=4))
        loss.backward()
    assert not calls


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gs_pooled_step_on_cuda_is_unchanged_by_training_layers(dtype):
    model = tiny_model("bert", attn="sdpa", num_layers=3).cuda()
    model.train()
    batch = {k: v.cuda() for k, v in tiny_batch("bert", batch=6).items()}
    batch["labels"] = torch.tensor([0, 1, 2, 0, 1, 2], device="cuda")
    pairs = torch.tensor([1, 0, 3, 2, 5, 4], device="cuda")

    def run(training_layers):
        gs = GradientSupervision(model, representation="pooled", mode="exact", training_layers=training_layers)
        out = []
        for seed in (11, 12, 13):
            torch.manual_seed(seed)
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                loss, _ = gs(batch, pairs)
            params = [p for p in model.parameters() if p.requires_grad]
            out.append((loss.detach(), torch.autograd.grad(loss, params, allow_unused=True)))
        return out

    run(True)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for (loss, grads), (loss_want, grads_want) in zip(run(True), run(False)):
        torch.testing.assert_close(loss, loss_want, rtol=tol, atol=tol)
        for a, b in zip(grads, grads_want):
            if b is None:
                assert a is None
                continue
            scale = b.abs().max().clamp_min(1e-6)
            assert (a - b).abs().max() / scale < tol
