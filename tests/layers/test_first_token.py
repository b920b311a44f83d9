"""cat_fast.layers.first_token's one-matmul keys and values for input-only passes (`INPUT_ONLY_KEY_VALUE`) against the
layer's own key and value modules: the same logits, input gradient and dropout draws."""
import pytest
import torch

from cat_fast import models
from cat_fast.layers import first_token
from cat_fast.objectives import CAT
from tests.conftest import tiny_batch, tiny_model

CUDA = torch.cuda.is_available()


def _count(monkeypatch):
    calls = []
    real = first_token._KeyValueFirst.apply
    monkeypatch.setattr(first_token._KeyValueFirst, "apply", lambda *a: calls.append(1) or real(*a))
    return calls


def _pass(model, cap, h, on, monkeypatch, seed=5):
    """(logits, input gradient) of an input-only counterfactual pass with the one-matmul keys and values on or off."""
    monkeypatch.setattr(first_token, "INPUT_ONLY_KEY_VALUE", on)
    h = h.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    logits = models.resume(model, cap, h, first_token=True, first_token_row_only=True, input_grad_only=True).logits
    (grad,) = torch.autograd.grad(logits.float().square().sum(), h)
    return logits, grad


@pytest.mark.parametrize("arch", ["bert", "roberta", "electra"])
@pytest.mark.parametrize("train", [False, True])
def test_same_logits_and_input_gradient_as_the_modules(arch, train, monkeypatch):
    model = tiny_model(arch, attn="sdpa", dtype=torch.float64, hidden_dropout_prob=0.3,
                       attention_probs_dropout_prob=0.3).train(train)
    cap = models.capture(model, tiny_batch(arch, batch=5), 1)
    assert models.first_token_ok(model, cap)
    calls = _count(monkeypatch)
    want = _pass(model, cap, cap.hidden, False, monkeypatch)
    assert calls == []
    got = _pass(model, cap, cap.hidden, True, monkeypatch)
    assert calls == [1]  # the last layer's keys and values in one matmul
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)  # the same dropout draws in train mode
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-12)


def test_other_layouts_hooks_and_passes_with_parameter_gradients_use_the_modules(monkeypatch):
    monkeypatch.setattr(first_token, "INPUT_ONLY_KEY_VALUE", True)
    calls = _count(monkeypatch)
    model = tiny_model("distilbert", attn="sdpa", dtype=torch.float64).eval()
    cap = models.capture(model, tiny_batch("distilbert"), 1)
    models.resume(model, cap, cap.hidden, first_token=True, input_grad_only=True)
    model = tiny_model("bert", attn="sdpa", dtype=torch.float64).eval()
    cap = models.capture(model, tiny_batch("bert"), 1)
    models.resume(model, cap, cap.hidden, first_token=True)  # parameter gradients may be taken: the modules
    assert calls == []
    seen = []
    key = models.structure(model).layer_modules[-1].attention.self.key
    handle = key.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape))
    try:
        models.resume(model, cap, cap.hidden, first_token=True, input_grad_only=True)
    finally:
        handle.remove()
    assert calls == [] and seen  # a hook on the key projection: it runs, on the modules' path
    models.resume(model, cap, cap.hidden, first_token=True, input_grad_only=True)
    assert calls == [1]


def test_under_cpu_autocast_the_input_gradient_is_summed_at_the_inputs_precision(monkeypatch):
    model = tiny_model("bert", attn="sdpa").eval()
    cap = models.capture(model, tiny_batch("bert", batch=5), 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _pass(model, cap, cap.hidden, False, monkeypatch)
        got = _pass(model, cap, cap.hidden, True, monkeypatch)
    assert got[1].dtype == want[1].dtype == torch.float32
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2e-2, atol=2e-2)
    assert (got[1] - want[1]).abs().max() <= 2e-2 * want[1].abs().max()


def test_cat_step_is_unchanged(monkeypatch):
    """CAT's CAL steps and final pass with the one-matmul keys and values: the same losses, λ and gradients in
    float64 with dropout on."""
    results = []
    calls = _count(monkeypatch)
    for on in (False, True):
        monkeypatch.setattr(first_token, "INPUT_ONLY_KEY_VALUE", on)
        model = tiny_model("bert", attn="sdpa", dtype=torch.float64, hidden_dropout_prob=0.3,
                           attention_probs_dropout_prob=0.3).train()
        cat = CAT(model, layers=[1], adv_steps=2, generator=torch.Generator().manual_seed(3))
        torch.manual_seed(0)
        erm, cf, info = cat.losses(tiny_batch("bert", batch=6))
        (erm + cf).backward()
        results.append((erm, cf, info["lambda_after"], [p.grad.clone() for p in model.parameters()
                                                        if p.grad is not None]))
    assert calls == [1, 1, 1]  # the two CAL steps and the final pass
    (e0, c0, l0, g0), (e1, c1, l1, g1) = results
    torch.testing.assert_close(e1, e0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(c1, c0, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(l1, l0, rtol=1e-10, atol=1e-12)
    assert len(g1) == len(g0)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_autocast_matches_the_modules_to_16_bit_rounding(monkeypatch):
    model = tiny_model("bert", attn="sdpa", hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3).cuda().train()
    cap = models.capture(model, {k: v.cuda() for k, v in tiny_batch("bert", batch=8, length=40).items()}, 1)
    calls = _count(monkeypatch)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = _pass(model, cap, cap.hidden, False, monkeypatch)
        got = _pass(model, cap, cap.hidden, True, monkeypatch)
    assert calls == [1]
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2e-2, atol=2e-2)
    assert (got[1] - want[1]).abs().max() <= 2e-2 * want[1].abs().max()
