"""The fast layers over peft LoRA projections: each read as one weight, W + scaling · B @ A (`layout.projection`),
against the model's own (peft) modules — outputs, input gradients and the gradients of A, B and the head — and the
configurations that keep the model's own layers (LoRA dropout in training mode, DoRA, merged adapters), said once."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from cat_fast import models
from cat_fast.layers import first_token, interventions, layout, resumed, training
from cat_fast.models.fast_layers import AdapterWarning
from tests.conftest import tiny_batch, tiny_model

peft = pytest.importorskip("peft")

TARGETS = {"query-value": ["query", "value"], "dense": ["dense"]}


def _lora_model(targets, dropout=0.0, num_layers=3, **lora):
    """A float64 tiny BERT (dropout 0.3) with LoRA of rank 4 on `targets`, B drawn at random (peft starts it at 0,
    where the adapters add nothing), the head trainable as `cat-fast train --lora` makes it."""
    model = tiny_model("bert", attn="sdpa", dtype=torch.float64, num_layers=num_layers, hidden_dropout_prob=0.3,
                       attention_probs_dropout_prob=0.3)
    peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets,
                                               **lora))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    for p in models.structure(model).head.parameters():
        p.requires_grad_(True)
    return model


def _trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _assert_same(got, want, tol=1e-10):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _own(layer, x, mask):
    out = layer(x, mask)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("targets", TARGETS.values(), ids=TARGETS.keys())
@pytest.mark.parametrize("train", [False, True])
def test_training_layer_equals_the_peft_layer(targets, train):
    model = _lora_model(targets)
    layer = models.structure(model).layer_modules[1]
    assert any(layout.lora(m) for m in layer.modules()) and training.supported(layer)
    layer.train(train)
    mask = models.inputs._padding_mask_4d(tiny_batch("bert")["attention_mask"])
    x = torch.randn(4, 9, 32, dtype=torch.float64)
    g = torch.randn(4, 9, 32, dtype=torch.float64)
    wrt = [p for p in layer.parameters() if p.requires_grad]
    assert len(wrt) == 2 * (2 if targets == ["query", "value"] else 3)  # A and B of each adapted projection
    results = []
    for run in (lambda t: _own(layer, t, mask), lambda t: training.forward(layer, (t, mask), {})):
        torch.manual_seed(3)
        t = x.clone().requires_grad_(True)
        y = run(t)
        results.append((y, *torch.autograd.grad(y, [t, *wrt], g)))
    assert all(gr.abs().max() > 0 for gr in results[0][1:])
    _assert_same(results[1], results[0])


@pytest.mark.parametrize("targets", TARGETS.values(), ids=TARGETS.keys())
def test_the_frozen_base_weight_gets_no_gradient(targets):
    model = _lora_model(targets)
    layer = models.structure(model).layer_modules[1]
    mask = models.inputs._padding_mask_4d(tiny_batch("bert")["attention_mask"])
    y = training.forward(layer, (torch.randn(4, 9, 32, dtype=torch.float64), mask), {})
    y.square().sum().backward()
    adapted = [m for m in layer.modules() if layout.lora(m)]
    assert adapted and all(m.base_layer.weight.grad is None for m in adapted)
    assert all(m.lora_A["default"].weight.grad is not None and m.lora_B["default"].weight.grad is not None
               for m in adapted)


def _logits_and_grads(model, batch, run, seed=5):
    torch.manual_seed(seed)
    logits = run(model, batch)
    named = _trainable(model)
    grads = torch.autograd.grad(F.cross_entropy(logits, batch["labels"]), [p for _, p in named], allow_unused=True)
    return (logits, *grads)


def _own_forward(model, batch):
    return model(**{k: v for k, v in batch.items() if k != "labels"}).logits


@pytest.mark.parametrize("targets", TARGETS.values(), ids=TARGETS.keys())
@pytest.mark.parametrize("train", [False, True])
def test_first_token_forward_with_training_layers_equals_the_peft_model(targets, train, monkeypatch):
    """The training layers (layers 0..L-2) and the first-token last layer, against the model's own forward in eval
    mode, and in train mode against the first-token forward on the model's own layers (the first-token layer's
    attention dropout draws are its own)."""
    calls = []
    real = training._TrainingLayer.apply
    monkeypatch.setattr(training._TrainingLayer, "apply", lambda *a: calls.append(1) or real(*a))
    model = _lora_model(targets).train(train)
    batch = tiny_batch("bert")
    fast = lambda m, b: models.first_token_forward(m, b, training_layers=True).logits  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error", AdapterWarning)
        _logits_and_grads(model, batch, fast)  # the first call records the layers' output format
        calls.clear()
        got = _logits_and_grads(model, batch, fast)
    assert len(calls) == 2  # layers 0 and 1; the last runs for the first token
    assert models.first_token_ready(model, batch)
    names = [n for n, _ in _trainable(model)]
    assert any("lora_A" in n for n in names) and any("lora_B" in n for n in names) and any("classifier" in n
                                                                                        for n in names)
    if train:
        reference = lambda m, b: models.first_token_forward(m, b).logits  # noqa: E731
    else:
        reference = _own_forward
    calls.clear()
    want = _logits_and_grads(model, batch, reference)
    assert calls == []
    assert all(g.abs().max() > 0 for g in want[1:])
    _assert_same(got, want)


@pytest.mark.parametrize("targets", TARGETS.values(), ids=TARGETS.keys())
@pytest.mark.parametrize("first", [False, True])
def test_resumed_layers_equal_the_peft_layers(targets, first, monkeypatch):
    """CAT's input-only passes (`layers.resumed`, and the first-token last layer's input-only path) and the
    training layers in a resumed pass, against the model's own layers: logits, input gradient and the parameters'."""
    calls = []
    real = resumed.forward
    monkeypatch.setattr(resumed, "forward", lambda *a: calls.append(1) or real(*a))
    model = _lora_model(targets, num_layers=4).train()
    batch = tiny_batch("bert", batch=5)
    cap = models.capture(model, batch, 1)
    assert models.first_token_ok(model, cap)

    def run(**options):
        h = cap.hidden.detach().clone().requires_grad_(True)
        torch.manual_seed(5)
        logits = models.resume(model, cap, h, first_token=first, **options).logits
        named = _trainable(model)
        return (logits, *torch.autograd.grad(logits.square().sum(), [h, *(p for _, p in named)], allow_unused=True))

    want = run()
    assert calls == []
    input_only = run(input_grad_only=True)
    assert len(calls) == (2 if first else 3)  # layers 2..4 of 4 resumed from h_1; the last for the first token
    _assert_same(input_only[:2], want[:2])
    _assert_same(run(training_layers=True), want)


def test_an_intervention_on_a_lora_layer_runs_on_the_effective_weights():
    model = _lora_model(["dense"])
    layer = models.structure(model).layer_modules[1].train()
    mask = models.inputs._padding_mask_4d(tiny_batch("bert")["attention_mask"])
    x = torch.randn(4, 9, 32, dtype=torch.float64)
    wrt = [p for p in layer.parameters() if p.requires_grad]
    results = []
    with interventions.intervene(layer, "intermediate", lambda a: a * torch.linspace(0, 1, a.shape[-1])):
        for run in (lambda t: _own(layer, t, mask), lambda t: training.forward(layer, (t, mask), {})):
            torch.manual_seed(3)
            t = x.clone().requires_grad_(True)
            y = run(t)
            results.append((y, *torch.autograd.grad(y.square().sum(), [t, *wrt])))
    _assert_same(results[1], results[0])


def test_lora_dropout_in_training_mode_keeps_the_models_layers_and_says_so(monkeypatch):
    calls = []
    real = training._TrainingLayer.apply
    monkeypatch.setattr(training._TrainingLayer, "apply", lambda *a: calls.append(1) or real(*a))
    model = _lora_model(["query", "value"], dropout=0.1).train()
    layer = models.structure(model).layer_modules[0]
    query = layer.attention.self.query
    assert layout.lora_refusal(query) == "lora_dropout 0.1 in training mode"
    assert not training.supported(layer) and not resumed.supported(layer)
    x = torch.randn(4, 9, 32, dtype=torch.float64, requires_grad=True)
    assert training.forward(layer, (x, None), {}) is None
    batch = tiny_batch("bert")
    with pytest.warns(AdapterWarning, match=r"wrapped by peft .*\(lora_dropout 0\.1 in training mode\)"):
        models.first_token_forward(model, batch, training_layers=True).logits.sum().backward()
    assert calls == []
    model.eval()  # the dropout is the identity in eval mode: the projection is one weight again
    assert layout.lora_refusal(query) is None and training.supported(layer)
    assert first_token.supported(layer)


@pytest.mark.parametrize("case", ["dora", "merged", "disabled"])
def test_other_configurations_keep_the_models_layers(case):
    model = _lora_model(["query", "value"], use_dora=case == "dora")
    layer = models.structure(model).layer_modules[0]
    query = layer.attention.self.query
    if case == "merged":
        query.merge()
    if case == "disabled":
        query.enable_adapters(False)
    want = {"dora": "DoRA", "merged": "adapters merged", "disabled": "adapters disabled"}[case]
    assert layout.lora_refusal(query) == want
    assert not training.supported(layer) and not resumed.supported(layer)
    assert layout.lora_refusal(layer.attention.self.key) is None  # not a peft module
