"""The torch.nn.Module wrappers of the ops: same values and gradients as the functional ops, on every backend;
constructor arguments checked once, errors naming them."""
import pytest
import torch

import cat_fast
from cat_fast.ops import CALObjective, CMix, CRMLoss, GSCosineLoss, cal_objective, cmix, crm_loss, gs_cosine_loss

from .conftest import run


def _logits(device, seed=0, rows=6, classes=4):
    generator = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(rows, classes, generator=generator)).to(device)
    cf_logits = (2 * torch.randn(rows, classes, generator=generator)).to(device)
    labels = torch.randint(0, classes, (rows,), generator=generator).to(device)
    labels[1] = -100
    return logits, cf_logits, labels


def _grads(fn, *tensors):
    leaves = [t.detach().requires_grad_() for t in tensors]
    out = fn(*leaves)
    first = out[0] if isinstance(out, tuple) else out
    first.sum().backward()
    return first.detach(), [leaf.grad for leaf in leaves]


def _assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], equal_nan=True)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w)


def test_modules_are_exported_and_are_modules():
    for name in ("CMix", "CALObjective", "CRMLoss", "GSCosineLoss"):
        assert name in cat_fast.ops.__all__
        module = getattr(cat_fast.ops, name)()
        assert isinstance(module, torch.nn.Module)
        assert list(module.parameters()) == [] and module.state_dict() == {}
    assert "ignore_index=-100" in repr(CRMLoss()) and "gamma=10.0, eta=20.0" in repr(CALObjective())


@pytest.mark.parametrize("mask_mode", ["self", "union"])
def test_cmix_module(backend, device, mask_mode):
    generator = torch.Generator().manual_seed(1)
    h = torch.randn(3, 4, 5, generator=generator).to(device)
    lam = torch.rand(3, 1, generator=generator).to(device)
    partner = torch.tensor([2, 0, 0], device=device)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], device=device)
    module = CMix(mask_mode)
    got = run(backend, module, h, lam, partner, mask)
    want = run(backend, cmix, h, lam, partner, mask, mask_mode)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _assert_same(_grads(lambda h, lam: run(backend, module, h, lam, partner, mask), h, lam),
                 _grads(lambda h, lam: run(backend, cmix, h, lam, partner, mask, mask_mode), h, lam))
    assert run(backend, module, h, 0.5, partner)[1] is None


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_cal_objective_module(backend, device, reduction):
    logits, _, labels = _logits(device)
    module = CALObjective(reduction=reduction)
    _assert_same(_grads(lambda z: run(backend, module, z, labels), logits),
                 _grads(lambda z: run(backend, cal_objective, z, labels, 10.0, 20.0, reduction, -100), logits))
    module = CALObjective(gamma=2.0, eta=-1.0, reduction=reduction, ignore_index=3)
    labels = labels.clamp_min(0)
    _assert_same(_grads(lambda z: run(backend, module, z, labels), logits),
                 _grads(lambda z: run(backend, cal_objective, z, labels, 2.0, -1.0, reduction, 3), logits))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("detach_weight", [True, False])
def test_crm_loss_module(backend, device, reduction, detach_weight):
    logits, cf_logits, labels = _logits(device, 2)
    module = CRMLoss(a1=0.5, a2=2.0, detach_weight=detach_weight, reduction=reduction)
    got = _grads(lambda z, zc: run(backend, module, z, zc, labels), logits, cf_logits)
    want = _grads(lambda z, zc: run(backend, crm_loss, z, zc, labels, 0.5, 2.0, detach_weight, reduction, -100),
                  logits, cf_logits)
    torch.testing.assert_close(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w)
    assert CRMLoss().reduction == "mean" and CRMLoss().a2 == 10.0 and CRMLoss().detach_weight is True


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_gs_cosine_loss_module(backend, device, reduction):
    generator = torch.Generator().manual_seed(3)
    g, g_hat = torch.randn(4, 3, 5, generator=generator).to(device), torch.randn(4, 3, 5, generator=generator).to(device)
    module = GSCosineLoss(reduction=reduction, eps=1e-6)
    _assert_same(_grads(lambda a, b: run(backend, module, a, b), g, g_hat),
                 _grads(lambda a, b: run(backend, gs_cosine_loss, a, b, reduction, 1e-6), g, g_hat))


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: CMix("both"), ValueError, "mask_mode: expected one of"),
        (lambda: CALObjective(gamma="10"), TypeError, "gamma: expected a number"),
        (lambda: CALObjective(eta=None), TypeError, "eta: expected a number"),
        (lambda: CALObjective(reduction="avg"), ValueError, "reduction: expected one of"),
        (lambda: CALObjective(ignore_index=1.0), TypeError, "ignore_index: expected an int"),
        (lambda: CRMLoss(a1=float("nan")), ValueError, "a1: expected a number that is not NaN"),
        (lambda: CRMLoss(a2=float("nan")), ValueError, "a2: expected a number that is not NaN"),
        (lambda: CRMLoss(a1=2.0, a2=1.0), ValueError, "a1, a2: expected a1 <= a2"),
        (lambda: CRMLoss(detach_weight=1), TypeError, "detach_weight: expected a bool"),
        (lambda: CRMLoss(reduction="avg"), ValueError, "reduction: expected one of"),
        (lambda: CRMLoss(ignore_index="x"), TypeError, "ignore_index: expected an int"),
        (lambda: GSCosineLoss(reduction="avg"), ValueError, "reduction: expected one of"),
        (lambda: GSCosineLoss(eps=0.0), ValueError, "eps: expected a finite number > 0"),
        (lambda: GSCosineLoss(eps=float("nan")), ValueError, "eps: expected a finite number > 0"),
        (lambda: GSCosineLoss(eps="1e-8"), TypeError, "eps: expected a number"),
    ],
)
def test_constructor_arguments_are_checked(make, error, words):
    with pytest.raises(error) as caught:
        make()
    assert words in str(caught.value)
