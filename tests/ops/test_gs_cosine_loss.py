import pytest
import torch

import cat_fast
from cat_fast.ops import gs_cosine_loss

from .conftest import assert_outputs_match, dtypes_for, noncontiguous, run


def _inputs(shape, dtype, device, seed, zero_row=False):
    generator = torch.Generator().manual_seed(seed)
    g = torch.randn(shape, generator=generator, dtype=torch.float64)
    g_hat = torch.randn(shape, generator=generator, dtype=torch.float64)
    if zero_row:
        g_hat[0] = 0
    return g.to(device=device, dtype=dtype), g_hat.to(device=device, dtype=dtype)


@pytest.mark.parametrize("shape", [(1, 1), (4, 37), (3, 5, 7), (2, 1025), (4, 16, 1024), (3, 20001)], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("zero_row", [False, True])
def test_matches_reference(backend, device, shape, reduction, zero_row):
    for seed, dtype in enumerate(dtypes_for(device)):
        if zero_row and dtype == torch.float16:
            continue  # the gradient at a zero row is ~1/eps = 1e8: beyond float16's range (inf), in every backend
        g, g_hat = _inputs(shape, dtype, device, seed, zero_row)
        grad_out = torch.randn(shape[0] if reduction == "none" else (), generator=torch.Generator().manual_seed(100 + seed), dtype=torch.float64).to(device)

        def outputs(which, g, g_hat):
            x, y = g.detach().requires_grad_(), g_hat.detach().requires_grad_()
            out = run(which, gs_cosine_loss, x, y, reduction)
            out.backward(grad_out.to(out.dtype))
            return out, x.grad, y.grad

        truth = outputs("reference", g.double(), g_hat.double())
        names = ("loss", "grad_g", "grad_g_hat")
        assert_outputs_match(names, outputs(backend, g, g_hat), outputs("reference", g, g_hat), truth, dtype)


def test_noncontiguous(backend, device):
    g, g_hat = _inputs((6, 8), torch.float32, device, 2)
    expected = run("reference", gs_cosine_loss, g, g_hat, "none")
    torch.testing.assert_close(run(backend, gs_cosine_loss, noncontiguous(g), noncontiguous(g_hat), "none"), expected)


def test_parallel_and_opposite_rows():
    g = torch.tensor([[1.0, 2.0], [1.0, 0.0], [0.0, 3.0]])
    g_hat = torch.tensor([[2.0, 4.0], [-5.0, 0.0], [1.0, 0.0]])
    for backend in cat_fast.backends():
        if cat_fast.ops.backend._device_ok(backend, "cpu"):
            out = run(backend, gs_cosine_loss, g, g_hat, "none")
            torch.testing.assert_close(out, torch.tensor([0.0, 2.0, 1.0]), msg=backend)


def test_gradcheck_and_gradgradcheck(backend, device):
    if device != "cpu":
        pytest.skip("float64 gradcheck runs on the CPU")
    g, g_hat = _inputs((3, 2, 4), torch.float64, device, 7)
    g.requires_grad_()
    g_hat.requires_grad_()

    def fn(x, y):
        return run(backend, gs_cosine_loss, x, y, "none")

    assert torch.autograd.gradcheck(fn, (g, g_hat))
    assert torch.autograd.gradgradcheck(fn, (g, g_hat))


def test_double_backward_through_an_input_gradient(backend, device):
    """GS builds g = d f / d x with create_graph=True; the loss must reach the parameters through g."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(5, 4, generator=generator, dtype=dtype).to(device).requires_grad_()
    x = torch.randn(6, 4, generator=generator, dtype=dtype).to(device).requires_grad_()
    g_hat = torch.randn(6, 4, generator=generator, dtype=dtype).to(device)

    def parameter_grad(which):
        f = torch.tanh(x @ weight.T)[:, 0].sum()
        (g,) = torch.autograd.grad(f, x, create_graph=True)
        loss = run(which, gs_cosine_loss, g, g_hat)
        (grad_weight,) = torch.autograd.grad(loss, weight)
        return grad_weight

    expected = parameter_grad("reference")
    assert expected.abs().sum() > 0
    torch.testing.assert_close(parameter_grad(backend), expected, rtol=1e-5, atol=1e-6)


def test_opcheck(backend, device):
    g, g_hat = _inputs((4, 9), torch.float32, device, 2)
    kernels = cat_fast.ops.registry.kernels(backend)
    torch.library.opcheck(kernels.gs_row_dots.default, (g.requires_grad_(), g_hat.requires_grad_()))
    coef = torch.randn(4, 4, device=device)
    torch.library.opcheck(kernels.gs_row_combine.default, (g, g_hat, coef.requires_grad_()))


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(g_hat=torch.randn(3, 5)), ValueError, "g_hat: expected shape (3, 4)"),
        (dict(g_hat=torch.randn(3, 4, dtype=torch.float64)), TypeError, "g_hat: expected dtype"),
        (dict(reduction="max"), ValueError, "reduction: expected one of"),
        (dict(eps=0.0), ValueError, "eps: expected a finite number > 0"),
        (dict(g=torch.tensor(1.0), g_hat=torch.tensor(1.0)), ValueError, "g: expected at least 1 dimension"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, words):
    args = dict(g=torch.randn(3, 4), g_hat=torch.randn(3, 4))
    args.update(kwargs)
    with pytest.raises(error) as caught:
        gs_cosine_loss(**args)
    assert words in str(caught.value)
