"""cat_fast.objectives.debias: each bias-model loss against a plain composition of its formula (docs/METHODS.md §4)
on a tiny BERT, gradients included, and the objectives' arguments and batch checks."""
import math

import pytest
import torch
import torch.nn.functional as F

from cat_fast import models, objectives, ops
from tests.conftest import tiny_batch, tiny_model


def _bias(B, C, seed=0):
    return torch.randn(B, C, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).log_softmax(-1)


def _formula(name, z, b, y, gate=None, teacher=None):
    if name == "poe":
        return F.cross_entropy(F.log_softmax(z, -1) + b, y)
    if name in ("reweight", "reweight-inverse"):
        p = b.exp()[torch.arange(len(y)), y]
        w = 1 - p if name == "reweight" else 1 / p
        return (w * F.cross_entropy(z, y, reduction="none")).sum() / w.sum()
    if name == "learned-mixin":
        g = F.softplus(gate).unsqueeze(1)
        lp = F.log_softmax(g * b, -1)
        return F.cross_entropy(F.log_softmax(z, -1) + g * b, y) + 0.03 * (-(lp.exp() * lp).sum(-1)).mean()
    t = teacher ** (1 - b.exp()[torch.arange(len(y)), y]).unsqueeze(1)
    t = t / t.sum(-1, keepdim=True)
    return -(t * F.log_softmax(z, -1)).sum(-1).mean()


@pytest.mark.parametrize("name", ["poe", "reweight", "reweight-inverse", "learned-mixin", "conf-reg"])
def test_objective_equals_its_formula(name):
    model = tiny_model("bert", num_labels=3, dtype=torch.float64).eval()
    batch = tiny_batch("bert", batch=5)
    batch["bias"] = _bias(5, 3)
    teacher = torch.softmax(torch.randn(5, 3, dtype=torch.float64), -1)
    batch["teacher_probs"] = teacher
    objective = objectives.build(name, model)
    loss, info = objective(batch)
    grads = torch.autograd.grad(loss, list(model.parameters()) + objective.parameters(), allow_unused=True)
    # the plain composition: the model's own forward, the formula written out
    out = model(**models.model_inputs(batch), output_hidden_states=False)
    gate = None
    if name == "learned-mixin":
        pooled = model.bert.pooler(model.bert(**models.model_inputs(batch)).last_hidden_state)
        gate = objective.gate(pooled).squeeze(-1)
    want = _formula(name, out.logits, batch["bias"], batch["labels"], gate, teacher)
    want_grads = torch.autograd.grad(want, list(model.parameters()) + objective.parameters(), allow_unused=True)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, want_grads):
        if b is None:
            assert a is None or float(a.abs().max()) == 0
        else:
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
    assert math.isfinite(float(info["ce_loss"]))


@pytest.mark.parametrize("name", ["poe", "reweight", "conf-reg", "learned-mixin"])
def test_prune_last_layer_false_runs_the_full_forward(name, monkeypatch):
    """``prune_last_layer=False``: the last layer runs for every token (no first-token forward), so under dropout
    the loss is the plain composition on the model's own forward, draw for draw."""
    model = tiny_model("bert", num_labels=3, dtype=torch.float64).train()
    batch = tiny_batch("bert", batch=5)
    batch["bias"] = _bias(5, 3)
    teacher = torch.softmax(torch.randn(5, 3, dtype=torch.float64), -1)
    batch["teacher_probs"] = teacher
    objective = objectives.build(name, model, prune_last_layer=False)

    def no_first_token_forward(*args, **kwargs):
        raise AssertionError("prune_last_layer=False ran the first-token forward")

    monkeypatch.setattr(models, "first_token_forward", no_first_token_forward)
    rows = []

    def last_layer_rows(mod, args, out):
        rows.append((out if isinstance(out, torch.Tensor) else out[0]).shape[1])

    hook = model.bert.encoder.layer[-1].register_forward_hook(last_layer_rows)
    torch.manual_seed(7)
    loss, _ = objective(batch)
    hook.remove()
    assert rows == [batch["input_ids"].shape[1]]  # every token, not the first one alone
    torch.manual_seed(7)
    out = model.bert(**models.model_inputs(batch))
    head_input = model.dropout(out.pooler_output)  # the gate reads what the classifier reads
    gate = objective.gate(head_input).squeeze(-1) if name == "learned-mixin" else None
    logits = model.classifier(head_input)
    want = _formula(name, logits, batch["bias"], batch["labels"], gate, teacher)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-10)


def test_ignored_rows_count_for_nothing():
    z = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    b, y = _bias(4, 3), torch.tensor([0, 2, -100, 1])
    full = ops.poe_loss(z, b, y)
    kept = ops.poe_loss(z[[0, 1, 3]], b[[0, 1, 3]], y[[0, 1, 3]])
    torch.testing.assert_close(full, kept)
    (g,) = torch.autograd.grad(full, z)
    assert float(g[2].abs().max()) == 0


def test_bad_inputs_name_the_argument():
    model = tiny_model("bert", num_labels=3)
    batch = tiny_batch("bert", batch=4)
    with pytest.raises(ValueError, match=r"needs batch\['bias'\]"):
        objectives.build("poe", model)(batch)
    with pytest.raises(ValueError, match=r"batch\['bias'\]: expected shape \(4, 3\)"):
        objectives.build("poe", model)(dict(batch, bias=torch.zeros(4, 2)))
    with pytest.raises(ValueError, match="weight: expected 'one_minus' or 'inverse'"):
        objectives.Reweight(model, weight="square")
    with pytest.raises(ValueError, match=r"needs batch\['teacher_probs'\]"):
        objectives.build("conf-reg", model)(dict(batch, bias=_bias(4, 3).float()))
    with pytest.raises(ValueError, match="gate: expected size 4"):
        ops.learned_mixin_loss(torch.zeros(4, 3), torch.zeros(4, 3), torch.zeros(4, dtype=torch.long), torch.zeros(3))
