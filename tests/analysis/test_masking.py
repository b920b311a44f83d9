"""Causal-grounded masking (cat_fast.analysis.masking): the first-token activations of chosen neurons scaled, on every
path, saved with the model."""
import pytest
import torch

from cat_fast import models
from cat_fast.analysis import masking
from tests.conftest import tiny_batch, tiny_model

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
NEURONS = [(1, "intermediate", 5), (1, "intermediate", 40), (2, "query", 3), (3, "output", 31), (3, "value", 0)]


def _batch(arch="bert"):
    return {k: v for k, v in tiny_batch(arch, batch=4).items() if k in INPUTS}


def _by_hand(model, batch, neurons, factor):
    """The same mask written as plain forward hooks on the component modules."""
    from cat_fast.layers import layout

    st = models.structure(model)
    handles = []
    for layer, comp, index in neurons:
        module = layout.component(st.layer_modules[layer - 1], comp)

        def hook(m, a, out, index=index):
            out = out.clone()
            out[:, 0, index] = out[:, 0, index] * factor
            return out

        handles.append(module.register_forward_hook(hook))
    try:
        return model(**batch).logits
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("arch", ["bert", "distilbert"])
@pytest.mark.parametrize("factor", [0.0, 0.5])
def test_mask_equals_hooks_and_changes_the_output(factor, arch):
    model = tiny_model(arch, dtype=torch.float64).eval()
    batch = _batch(arch)
    plain = model(**batch).logits
    want = _by_hand(model, batch, NEURONS, factor)
    masking.mask_neurons(model, NEURONS, factor)
    got = model(**batch).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert (got - plain).abs().max() > 1e-9
    # the first-token forward (cat_fast's fast path) applies it too
    torch.testing.assert_close(models.first_token_forward(model, batch).logits, want, rtol=1e-9, atol=1e-10)
    masking.unmask_neurons(model)
    torch.testing.assert_close(model(**batch).logits, plain, rtol=0, atol=0)
    assert masking.masked_neurons(model) is None


def test_mask_survives_save_and_load(tmp_path):
    model = tiny_model("bert").eval()
    batch = _batch()
    masking.mask_neurons(model, NEURONS + [(2, "query", 3)], 0.0)  # duplicates are merged
    want = model(**batch).logits
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForSequenceClassification

    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    unmasked = loaded(**batch).logits
    assert (unmasked - want).abs().max() > 1e-6  # from_pretrained alone runs unmasked (documented)
    masking.apply_saved_mask(loaded)
    torch.testing.assert_close(loaded(**batch).logits, want)
    assert masking.masked_neurons(loaded)["neurons"] == [list(n) for n in sorted(NEURONS)]


def test_factor_one_changes_nothing():
    model = tiny_model("bert").eval()
    batch = _batch()
    plain = model(**batch).logits
    masking.mask_neurons(model, NEURONS, 1.0)
    torch.testing.assert_close(model(**batch).logits, plain, rtol=0, atol=0)


def test_remasking_replaces_the_mask():
    model = tiny_model("bert", dtype=torch.float64).eval()
    batch = _batch()
    want = _by_hand(model, batch, NEURONS[:1], 0.0)
    masking.mask_neurons(model, NEURONS, 0.0)
    masking.mask_neurons(model, NEURONS[:1], 0.0)
    torch.testing.assert_close(model(**batch).logits, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("neurons, words", [
    ([(0, "query", 1)], "layer 0 is not in [1, 3]"),
    ([(1, "mlp", 1)], "component 'mlp' is not one of"),
    ([(1, "query", 32)], "index 32 of layer 1 query is not in [0, 32)"),
    ([(1, "intermediate", 64)], "index 64 of layer 1 intermediate is not in [0, 64)"),
    ([5], "expected (layer, component, index) items"),
])
def test_bad_neurons_name_the_problem(neurons, words):
    model = tiny_model("bert")
    with pytest.raises(ValueError) as caught:
        masking.mask_neurons(model, neurons)
    assert words in str(caught.value)
    with pytest.raises(ValueError, match="factor: expected a finite number"):
        masking.mask_neurons(model, NEURONS, float("nan"))


def test_rescale_is_inverted_dropout_on_the_component():
    """rescale=True: the masked neurons get factor, the component's other first-token activations width / (width − k)
    (k masked neurons of that component); saved and restored with the mask."""
    model = tiny_model("bert", dtype=torch.float64).eval()
    batch = _batch()
    from cat_fast.layers import layout

    module = layout.component(models.structure(model).layer_modules[0], "intermediate")

    def hook(m, a, out):
        out = out.clone()
        first = out[:, 0] * (64 / 62)
        first[:, [5, 40]] = 0.0
        out[:, 0] = first
        return out

    handle = module.register_forward_hook(hook)
    try:
        want = model(**batch).logits
    finally:
        handle.remove()
    masking.mask_neurons(model, NEURONS[:2], 0.0, rescale=True)
    torch.testing.assert_close(model(**batch).logits, want, rtol=0, atol=1e-12)
    assert masking.masked_neurons(model)["rescale"] is True
    with pytest.raises(ValueError, match="every neuron of layer 1 intermediate is masked"):
        masking.mask_neurons(model, [(1, "intermediate", i) for i in range(64)], rescale=True)
    with pytest.raises(ValueError, match="rescale: expected a bool"):
        masking.mask_neurons(model, NEURONS, rescale=1)
