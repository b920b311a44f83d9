"""cat_fast.layers.interventions / models.intervene: an edit of a layer's activations is applied identically by the
model's own modules (checked against a plain forward hook written here) and by the fast layers, which honour it
instead of falling back to the model's code."""
import pytest
import torch

from cat_fast import layers, models
from tests.conftest import tiny_batch, tiny_model

COMPONENTS = ("query", "key", "value", "attention_output", "intermediate", "output")
# the module of a Bert layer whose output each component is, written out here (not read from cat_fast's table)
BERT_MODULES = {"query": "attention.self.query", "key": "attention.self.key", "value": "attention.self.value",
                "attention_output": "attention.output", "intermediate": "intermediate", "output": "output"}


def _edit(x):
    """A non-linear, position-dependent edit that changes every row (so a missed or doubled call shows)."""
    scale = torch.linspace(0.5, 1.5, x.shape[-1], dtype=x.dtype, device=x.device)
    return torch.tanh(x) * scale + 0.1


def _model(train=False, arch="bert"):
    model = tiny_model(arch, attn="sdpa", dtype=torch.float64, num_labels=3, hidden_dropout_prob=0.2,
                       attention_probs_dropout_prob=0.2)
    return model.train(train)


def _submodule(module, path):
    for name in path.split("."):
        module = getattr(module, name)
    return module


def _logits_and_grads(model, run, seed=5):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    logits = run()
    logits.float().pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return logits.detach(), grads


def _assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=1e-10, atol=1e-10)
    assert len(ga) == len(gb)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("component", COMPONENTS)
@pytest.mark.parametrize("train", [False, True])
def test_training_layers_honour_an_intervention(component, train, monkeypatch):
    model = _model(train)
    batch = tiny_batch("bert", batch=4, length=9, num_labels=3)
    layer = models.structure(model).layer_modules[1]

    handle = _submodule(layer, BERT_MODULES[component]).register_forward_hook(lambda m, a, out: _edit(out))
    try:
        # the model's own layers (and the same first-token last layer), a plain hook
        want = _logits_and_grads(model, lambda: models.first_token_forward(model, batch).logits)
    finally:
        handle.remove()
    plain = _logits_and_grads(model, lambda: models.first_token_forward(model, batch).logits)
    assert (want[0] - plain[0]).abs().max() > 1e-8  # the edit changes the logits

    models.first_token_forward(model, batch, training_layers=True)  # the first call records the layers' format
    calls = []
    composed = layers.training._composed
    monkeypatch.setattr(layers.training, "_composed", lambda *a: calls.append(1) or composed(*a))
    with models.intervene(model, 2, component, _edit):
        assert layers.training.supported(layer)  # the intervention is not a reason to refuse the layer
        got = _logits_and_grads(model, lambda: models.first_token_forward(model, batch, training_layers=True).logits)
    assert calls  # the training layer applied it, not the model's own layer
    _assert_same(got, want)
    # gone after the block: the fused node again, the plain logits
    again = _logits_and_grads(model, lambda: models.first_token_forward(model, batch, training_layers=True).logits)
    _assert_same(again, plain)
    assert layers.interventions.active(layer) is None


@pytest.mark.parametrize("component", COMPONENTS)
@pytest.mark.parametrize("index, train", [(2, False), (2, True), (3, False)])
def test_resumed_and_first_token_layers_honour_an_intervention(component, index, train):
    """Layer 2 of 3 runs `layers.resumed`; layer 3, the last, `layers.first_token` (eval: a full capture's last
    layer draws other dropout masks for row 0 alone)."""
    model = _model(train=train, arch="bert")
    batch = tiny_batch("bert", batch=4, length=9, num_labels=3)
    st = models.structure(model)
    assert models.first_token_ready(model, batch)
    with models.intervene(model, index, component, _edit):
        torch.manual_seed(0)
        cap = models.capture(model, batch, 1)
        results = []
        for fast in (False, True):  # the model's own layers, then layers.resumed / layers.first_token
            h = cap.hidden.detach().requires_grad_(True)
            out = models.resume(model, cap, h, first_token=fast and index == st.num_layers,
                                input_grad_only=fast)
            logits = models.logits_of(out)
            (g,) = torch.autograd.grad(logits.pow(2).sum(), h)
            results.append((logits.detach(), g))
    (l_own, g_own), (l_fast, g_fast) = results
    torch.testing.assert_close(l_fast, l_own, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(g_fast, g_own, rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        torch.manual_seed(0)
        clean = models.logits_of(models.resume(model, models.capture(model, batch, 1), cap.hidden.detach()))
    assert (clean - l_own).abs().max() > 1e-8


def test_resumed_layer_applies_interventions_itself(monkeypatch):
    model = _model()
    batch = tiny_batch("bert", batch=3, length=7, num_labels=3)
    calls = []
    composed = layers.resumed._composed
    monkeypatch.setattr(layers.resumed, "_composed", lambda *a: calls.append(dict(a[-1]) if isinstance(a[-1], dict) else None) or composed(*a))
    cap = models.capture(model, batch, 1)
    with models.intervene(model, 2, "intermediate", _edit):
        models.resume(model, cap, cap.hidden.detach(), input_grad_only=True)
    assert any(c and "intermediate" in c for c in calls)


def test_interventions_stack_and_unwind():
    model = _model()
    layer = models.structure(model).layer_modules[0]
    double = lambda x: 2 * x  # noqa: E731
    with models.intervene(model, 1, "value", double):
        with models.intervene(model, 1, "value", _edit):
            assert layers.interventions.active(layer)["value"] == [double, _edit]
        assert layers.interventions.active(layer)["value"] == [double]
    assert layers.interventions.active(layer) is None
    assert not any(m._forward_hooks for m in layer.modules())


def test_bad_arguments_are_clear_errors():
    model = _model()
    with pytest.raises(ValueError, match="component: expected one of"):
        with models.intervene(model, 1, "pooler", _edit):
            pass
    with pytest.raises(ValueError, match=r"layer: expected an integer in \[1, 3\]"):
        with models.intervene(model, 0, "value", _edit):
            pass
    with pytest.raises(TypeError, match="fn: expected a callable"):
        with models.intervene(model, 1, "value", 3.0):
            pass
    albert = tiny_model("albert", attn="sdpa")
    with pytest.raises(ValueError, match="layer: .* one module for several layers"):
        models.intervene(albert, 1, "value", _edit)


def test_distilbert_components_are_found():
    model = tiny_model("distilbert", attn="sdpa")
    layer = models.structure(model).layer_modules[0]
    assert layers.layout.family(layer) == "distilbert"
    assert layers.layout.component(layer, "query") is layer.attention.q_lin
    assert layers.layout.component(layer, "intermediate") is layer.ffn.activation
    assert layers.layout.component(layer, "output") is layer.output_layer_norm
