"""CLP (cat_fast.objectives.clp): the true-class perturbation changes the training gradient, Ω's meta-gradient is the
derivative of the meta loss (finite differences), Ω alone can drive a tiny meta loss down, and the objective runs on a
Hugging Face classifier and on a plain module."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cat_fast.objectives.clp import CLP, PerturbationNet, find_head
from tests.conftest import tiny_batch, tiny_model


class Plain(nn.Module):
    """A plain classifier over feature vectors: Linear → tanh → Linear head."""

    def __init__(self, d=6, h=5, c=3, dtype=torch.float64):
        super().__init__()
        self.body = nn.Linear(d, h, dtype=dtype)
        self.head = nn.Linear(h, c, dtype=dtype)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def _plain_batches(n, b=8, d=6, c=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [{"inputs": torch.randn(b, d, generator=g, dtype=dtype), "labels": torch.randint(0, c, (b,), generator=g)}
            for _ in range(n)]


def test_true_class_perturbation_changes_the_gradient_an_all_logit_shift_does_not():
    torch.manual_seed(0)
    z = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 1, 2, 1, 0])
    delta = torch.tensor([0.7, -0.4, 0.3, 1.1, -0.9], dtype=torch.float64)
    (g_plain,) = torch.autograd.grad(F.cross_entropy(z, y), z)
    (g_all,) = torch.autograd.grad(F.cross_entropy(z + delta[:, None], y), z)
    (g_true,) = torch.autograd.grad(F.cross_entropy(z + delta[:, None] * F.one_hot(y, 3), y), z)
    torch.testing.assert_close(g_all, g_plain)  # a shift of every logit is a no-op under softmax
    assert (g_true - g_plain).abs().max() > 1e-2

    # through the objective: with Ω producing a non-zero δ the model's gradient differs from ERM's
    model = Plain()
    batch = _plain_batches(1)[0]
    obj = CLP(model, _plain_batches(2, seed=1), virtual_lr=0.1, meta_lr=1e-12)
    with torch.no_grad():
        obj.omega.fc2.bias.fill_(2.0)  # tanh(≈2) ≈ 0.96: δ ≈ 0.96 for every row
    loss, info = obj(batch)
    assert float(info["delta_abs_mean"]) > 0.5
    grads = torch.autograd.grad(loss, list(model.parameters()))
    erm = torch.autograd.grad(F.cross_entropy(model(batch["inputs"]), batch["labels"]), list(model.parameters()))
    assert max(float((a - b).abs().max()) for a, b in zip(grads, erm)) > 1e-3


@pytest.mark.parametrize("virtual", ["head", "all"])
def test_meta_gradient_equals_finite_differences(virtual):
    torch.manual_seed(0)
    model = Plain()
    batch = _plain_batches(1)[0]
    meta = _plain_batches(1, seed=3)[0]
    obj = CLP(model, [meta], virtual=virtual, virtual_lr=0.5)
    obj.omega.double()
    logits, features = obj._call(batch)
    from cat_fast import ops

    chars = ops.sample_characteristics(logits.detach(), batch["labels"], features.detach(),
                                       obj.head.weight.detach(), obj.class_stats().double())
    onehot = F.one_hot(batch["labels"], 3).double()

    def meta_loss():
        delta = obj.omega(chars)
        if virtual == "head":  # (the metadata loss after the virtual step, before it, the step's size)
            return obj._meta_head(features.detach(), batch["labels"], onehot, delta, meta, 0.5)[0]
        z, _ = obj._call(batch)
        return obj._meta_all(z, batch["labels"], onehot, delta, meta, 0.5)[0]

    params = list(obj.omega.parameters())
    grads = torch.autograd.grad(meta_loss(), params)
    eps = 1e-6
    checked = 0
    for p, g in zip(params, grads):
        for i in range(0, p.numel(), max(1, p.numel() // 4)):
            with torch.no_grad():
                p.view(-1)[i] += eps
            up = float(meta_loss().detach())  # the virtual step inside needs autograd: outside no_grad
            with torch.no_grad():
                p.view(-1)[i] -= 2 * eps
            down = float(meta_loss().detach())
            with torch.no_grad():
                p.view(-1)[i] += eps
            fd = (up - down) / (2 * eps)
            assert abs(fd - float(g.view(-1)[i])) <= 1e-6 + 1e-4 * abs(fd), (p.shape, i, fd, float(g.view(-1)[i]))
            checked += 1
    assert checked >= 12 and max(float(g.abs().max()) for g in grads) > 1e-6  # a non-trivial gradient


def test_omega_alone_lowers_the_meta_loss():
    """The classifier never steps; only Ω learns, through the virtual step: the meta loss falls by a third (Ω learns
    to scale the true-class perturbation so that the virtual step fits the metadata better)."""
    torch.manual_seed(0)
    model = Plain()
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.zero_()
    data = _plain_batches(1, b=4, seed=5)[0]
    obj = CLP(model, [data], virtual_lr=1.0, scale=20.0, meta_lr=3e-2)
    losses = [float(obj(data)[1]["meta_loss"]) for _ in range(300)]
    assert losses[-1] < 0.7 * losses[0], (losses[0], losses[-1])
    assert all(torch.equal(p, torch.zeros_like(p)) for p in model.head.parameters())  # untouched classifier


def test_tiny_meta_set_is_driven_near_zero():
    """The whole loop (Ω's meta step, then the classifier's real step) on a 4-example metadata set: the meta loss
    goes from ~1 to near zero."""
    torch.manual_seed(0)
    model = Plain()
    data = _plain_batches(1, b=4, seed=5)[0]
    obj = CLP(model, [data])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    obj.set_optimizer(optimizer)  # the virtual step takes the optimizer's learning rate
    losses = []
    for _ in range(200):
        loss, info = obj(data)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(info["meta_loss"]))
    assert losses[0] > 0.5 and losses[-1] < 0.01, (losses[0], losses[-1])


@pytest.mark.parametrize("virtual", ["head", "all"])
def test_hugging_face_classifier_trains(virtual):
    model = tiny_model("bert", attn="eager" if virtual == "all" else "sdpa")
    batch = {k: v for k, v in tiny_batch("bert", batch=6, seed=0).items() if k != "pairs"}
    meta = {k: v for k, v in tiny_batch("bert", batch=4, seed=1).items() if k != "pairs"}
    obj = CLP(model, [meta], virtual=virtual, epoch_size=12)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    obj.set_optimizer(optimizer)
    assert obj.head is model.classifier
    omega_before = copy.deepcopy(obj.omega.state_dict())
    for _ in range(3):
        loss, info = obj(batch)
        assert torch.isfinite(loss) and set(info) == {"ce_loss", "meta_loss", "delta_mean", "delta_abs_mean",
                                                      "meta_grad_norm", "virtual_step", "meta_loss_change"}
        optimizer.zero_grad()
        loss.backward()
        assert model.bert.embeddings.word_embeddings.weight.grad.abs().sum() > 0
        optimizer.step()
    assert any(not torch.equal(v, obj.omega.state_dict()[k]) for k, v in omega_before.items())
    assert obj._last is not None  # 18 examples seen with epoch_size=12: one epoch's statistics kept
    stats = obj.class_stats()
    assert stats.shape == (model.config.num_labels, 3) and torch.isfinite(stats).all()


def test_class_statistics_and_state_round_trip():
    model = Plain()
    batches = _plain_batches(3, b=4, seed=7)
    obj = CLP(model, batches[:1], virtual_lr=0.1, epoch_size=8, class_prior=[2, 1, 1])
    torch.testing.assert_close(obj.class_stats()[:, 0], torch.tensor([0.5, 0.25, 0.25]))
    for b in batches[:2]:
        obj(b)
    labels = torch.cat([b["labels"] for b in batches[:2]])
    counts = torch.bincount(labels, minlength=3).float()
    # the mean loss per class of the finished epoch is the mean of column 0 of the characteristics it saw
    assert obj._last is not None and obj._seen == 0
    assert torch.equal(obj._last[:, 1] != 0, counts > 0)
    state = obj.state_dict()
    other = CLP(Plain(), batches[:1], virtual_lr=0.1, epoch_size=8, class_prior=[2, 1, 1])
    other.load_state_dict(state)
    torch.testing.assert_close(other.class_stats(), obj.class_stats())
    assert other.step == obj.step == 2
    for (k, v) in obj.omega.state_dict().items():
        torch.testing.assert_close(other.omega.state_dict()[k], v)


@pytest.mark.parametrize("kwargs, words", [
    (dict(virtual="some"), "virtual: expected 'head' or 'all'"),
    (dict(scale=0.0), "scale: expected a finite number in (0, inf)"),
    (dict(meta_lr=-1.0), "meta_lr: expected a finite number in (0, inf)"),
    (dict(class_prior=[1, 1]), "class_prior: expected 3 non-negative"),
    (dict(epoch_size=0), "epoch_size: expected a finite number in [1, inf)"),
])
def test_bad_arguments(kwargs, words):
    with pytest.raises((ValueError, TypeError)) as caught:
        CLP(Plain(), _plain_batches(1), **kwargs)
    assert words in str(caught.value)


def test_missing_learning_rate_and_head_are_clear_errors():
    obj = CLP(Plain(), _plain_batches(1))
    with pytest.raises(ValueError, match="virtual_lr: not set and no optimizer"):
        obj(_plain_batches(1)[0])
    with pytest.raises(ValueError, match="head: no nn.Linear with 7 outputs"):
        find_head(Plain(), num_labels=7)
    assert PerturbationNet(hidden=4, scale=2.0)(torch.randn(5, 10)).abs().max() <= 2.0
