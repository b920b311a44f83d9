import pytest
import torch

import cat_fast
from cat_fast.ops import cal_step_

from .conftest import run


def _inputs(shape, dtype, device, seed, zero_rows=False):
    generator = torch.Generator().manual_seed(seed)
    lam = torch.rand(shape, generator=generator, dtype=torch.float64)
    lam[0] = -0.3 if not zero_rows else 0.0
    grad = torch.randn(shape, generator=generator, dtype=torch.float64)
    return lam.to(device=device, dtype=dtype), grad.to(device=device, dtype=dtype)


@pytest.mark.parametrize("shape", [(1,), (7,), (1, 1), (4, 9), (3, 130)], ids=str)
@pytest.mark.parametrize("p", [1.0, 2.0, 3.5])
@pytest.mark.parametrize("zero_rows", [False, True])
def test_matches_reference(backend, device, shape, p, zero_rows):
    dtypes = (torch.float64, torch.float32) if device == "cpu" else (torch.float32,)
    for seed, dtype in enumerate(dtypes):
        lam, grad = _inputs(shape, dtype, device, seed, zero_rows)
        expected = run("reference", cal_step_, lam.clone(), grad, 0.05, p, 0.0, 1.0)
        target = lam.clone()
        returned = run(backend, cal_step_, target, grad, 0.05, p, 0.0, 1.0)
        assert returned is target
        tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(target, expected, **tol)


def test_known_values_p1():
    lam = torch.tensor([0.5, 0.0, 0.99, 0.2])
    grad = torch.tensor([1.0, 1.0, 1.0, -10.0])
    for backend in cat_fast.backends():
        if cat_fast.ops.backend._device_ok(backend, "cpu"):
            out = run(backend, cal_step_, lam.clone(), grad, 0.1, 1.0, 0.0, 1.0)
            torch.testing.assert_close(out, torch.tensor([0.5, 0.1, 0.99, 0.0]), msg=backend)


def test_bf16_lambda_is_updated_in_place(backend, device):
    lam, grad = _inputs((5,), torch.bfloat16, device, 3)
    expected = run("reference", cal_step_, lam.float(), grad.float(), 0.1, 1.0, 0.0, 1.0)
    target = lam.clone()
    run(backend, cal_step_, target, grad, 0.1, 1.0, 0.0, 1.0)
    assert target.dtype == torch.bfloat16
    torch.testing.assert_close(target.float(), expected, rtol=1e-2, atol=1e-2)


def test_leaf_that_requires_grad_is_updated(backend, device):
    lam, grad = _inputs((4,), torch.float32, device, 5)
    lam.requires_grad_()
    expected = run("reference", cal_step_, lam.detach().clone(), grad, 0.1, 1.0, 0.0, 1.0)
    run(backend, cal_step_, lam, grad, 0.1, 1.0, 0.0, 1.0)
    torch.testing.assert_close(lam.detach(), expected)


def test_opcheck(backend, device):
    lam, grad = _inputs((4, 3), torch.float32, device, 2)
    kernels = cat_fast.ops.registry.kernels(backend)
    torch.library.opcheck(kernels.cal_step_.default, (lam, grad, 0.1, 2.0, 0.0, 1.0))


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(grad=torch.randn(4)), ValueError, "grad: expected shape (3,)"),
        (dict(lam=torch.rand(3, 2, 2), grad=torch.rand(3, 2, 2)), ValueError, "lam: expected a 1-D or 2-D"),
        (dict(p=0.5), ValueError, "p: expected a finite norm order >= 1"),
        (dict(p=float("inf")), ValueError, "p: expected a finite norm order >= 1"),
        (dict(lo=1.0, hi=0.0), ValueError, "expected lo <= hi"),
        (dict(lr=None), TypeError, "lr: expected a number"),
        (dict(grad=torch.ones(3, dtype=torch.long)), TypeError, "grad: expected dtype"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, words):
    args = dict(lam=torch.rand(3), grad=torch.randn(3), lr=0.1, p=1.0, lo=0.0, hi=1.0)
    args.update(kwargs)
    with pytest.raises(error) as caught:
        cal_step_(**args)
    assert words in str(caught.value)


@pytest.mark.parametrize("p", [1.0, 2.0])
def test_a_nan_gradient_gives_nan_lambda_as_the_reference(backend, device, p):
    # clamp(NaN, lo, hi) is NaN (torch.clamp, the reference): a NaN gradient must not set λ to lo and hide itself.
    lam, grad = _inputs((4, 3), torch.float32, device, 0)
    grad[1, 2] = float("nan")
    expected = run("reference", cal_step_, lam.clone(), grad, 0.05, p, 0.0, 1.0)
    target = lam.clone()
    run(backend, cal_step_, target, grad, 0.05, p, 0.0, 1.0)
    assert torch.equal(target.isnan(), expected.isnan()) and bool(target[1, 2].isnan())
    torch.testing.assert_close(target, expected, equal_nan=True, rtol=1e-6, atol=1e-6)
