"""`ERM(fast=True)`: the model's own loss and gradients through `first_token_forward` with the training layers."""
import os

import pytest
import torch
import torch.nn.functional as F

from cat_fast import models
from cat_fast.objectives import ERM
from cat_fast.step import CapturedStep
from tests.conftest import tiny_batch, tiny_model


def _loss_and_grads(model, objective, batch):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # the same dropout draws for both forwards
    loss, info = objective(batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class _PrunedComposition:
    """The plain composition: the model's own layers with the last one cut to the first token, then cross-entropy."""

    def __init__(self, model):
        self.model = model

    def __call__(self, batch):
        logits = models.first_token_forward(self.model, batch, training_layers=False).logits
        return F.cross_entropy(logits, batch["labels"]), {}


@pytest.mark.parametrize("arch", ["bert", "roberta", "distilbert"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "dropout"])
def test_fast_erm_is_the_models_own_loss_and_gradients(arch, train):
    """Without dropout: the model's own loss and gradients. With dropout the cut last layer draws masks for the
    first token only, so the draws differ from the full forward's: then the same as the model's own layers with that
    cut, mask for mask."""
    model = tiny_model(arch, seed=1).train(train)
    batch = tiny_batch(arch, batch=5)  # padded rows included
    reference = _PrunedComposition(model) if train else ERM(model)
    want, want_grads = _loss_and_grads(model, reference, batch)
    got, got_grads = _loss_and_grads(model, ERM(model, fast=True), batch)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs Triton kernels under the interpreter")
def test_fast_erm_with_the_training_row_is_the_models_own_loss_and_gradients(monkeypatch):
    """The last layer as one autograd node (`layers.first_token.TRAINING_ROW`; allowed on the CPU here, its kernels
    under the Triton interpreter), in train mode with hidden dropout: the loss and every gradient of the model's own
    layers cut to the first token, to fp32 rounding."""
    from cat_fast.layers import first_token
    from cat_fast.ops.fused import fused_kernels

    kernels = tuple(fused_kernels(name) for name in ("residual_layer_norm", "gelu_bias_backward", "column_sums",
                                                      "first_row_attention"))
    if None in kernels:
        pytest.skip("needs Triton")
    calls = []
    real = first_token._TrainingRow.apply
    monkeypatch.setattr(first_token._TrainingRow, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(first_token, "_row_kernels", lambda x, dtype, layer_norm_dtype: kernels)
    # the training layers' conditions: SDPA attention; no attention dropout: SDPA draws its own on the CPU
    model = tiny_model("bert", attn="sdpa", seed=1, attention_probs_dropout_prob=0.0).train(True)
    batch = tiny_batch("bert", batch=5)
    monkeypatch.setattr(first_token, "TRAINING_ROW", False)  # the reference: the last layer's own modules
    want, want_grads = _loss_and_grads(model, _PrunedComposition(model), batch)
    assert calls == []
    monkeypatch.setattr(first_token, "TRAINING_ROW", True)
    got, got_grads = _loss_and_grads(model, ERM(model, fast=True), batch)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for n in want_grads:
        scale = want_grads[n].abs().max().clamp_min(1e-3)
        assert (got_grads[n] - want_grads[n]).abs().max() <= 1e-4 * scale, n


def test_fast_erm_through_captured_step_on_the_cpu_equals_the_loop():
    batches = [tiny_batch("bert", batch=4, seed=s) for s in range(3)]
    params = []
    for captured in (None, False):
        torch.manual_seed(0)
        model = tiny_model("bert", seed=1).train()
        objective = ERM(model, fast=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = CapturedStep(objective, opt, cuda_graph=False) if captured is False else None
        for batch in batches:
            if step is not None:
                step(batch)
            else:
                objective(batch)[0].backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for n in params[0]:
        torch.testing.assert_close(params[1][n], params[0][n], rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("fast", [False, True], ids=["plain", "fast"])
def test_erm_leaves_the_bias_models_columns_out_of_the_forward(fast):
    """A batch that carries a bias model's log-probabilities (and a teacher's probabilities) trains ERM as without
    them: they are data for the bias-model losses, not arguments of the model's forward."""
    model = tiny_model("bert", seed=1).eval()
    batch = tiny_batch("bert", batch=5)
    extra = {"bias": torch.randn(5, 3).log_softmax(-1), "teacher_probs": torch.randn(5, 3).softmax(-1)}
    want, want_grads = _loss_and_grads(model, ERM(model, fast=fast), batch)
    given = []
    hook = model.register_forward_pre_hook(lambda mod, args, kwargs: given.append(set(kwargs)), with_kwargs=True)
    got, got_grads = _loss_and_grads(model, ERM(model, fast=fast), {**batch, **extra})
    hook.remove()
    assert given and not any(keys & set(extra) for keys in given), given
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got_grads.keys() == want_grads.keys()
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=0, atol=0, msg=n)


def test_fast_erm_refuses_what_it_does_not_compute():
    model = tiny_model("bert", num_labels=1)  # regression: MSE, not cross-entropy
    batch = tiny_batch("bert")
    with pytest.raises(ValueError, match="ERM\\(fast=True\\): expected a single-label sequence classifier"):
        ERM(model, fast=True)(dict(batch, labels=batch["labels"].float()))
    model = tiny_model("bert")
    with pytest.raises(ValueError, match="ERM: the batch has no 'labels'"):  # Objective.check_batch
        ERM(model, fast=True)({k: v for k, v in batch.items() if k != "labels"})
    with pytest.raises(ValueError, match="integer labels of shape"):
        ERM(model, fast=True)(dict(batch, labels=batch["labels"].float()))
    with pytest.raises(ValueError, match="does not combine with extra_optimizer"):
        ERM(model, fast=True, two_step=True)
    with pytest.raises(TypeError, match="fast: expected True or False"):
        ERM(model, fast=1)


@pytest.mark.parametrize("config", [dict(num_labels=1), dict(problem_type="multi_label_classification")])
def test_cat_and_fast_erm_refuse_other_than_single_label_classifiers(config):
    from cat_fast.objectives import CAT
    model = tiny_model("bert", **config)
    for make, who in ((lambda: ERM(model, fast=True), "ERM\\(fast=True\\)"), (lambda: CAT(model), "CAT")):
        with pytest.raises(ValueError, match=f"{who}: expected a single-label sequence classifier"):
            make()
