import pytest
import torch

import cat_fast
from cat_fast.ops import cal_objective

from .conftest import assert_outputs_match, dtypes_for, noncontiguous, run, without_ties

SHAPES = [(1, 2), (5, 3), (8, 7), (3, 130)]


def _inputs(shape, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = without_ties(3 * torch.randn(shape, generator=generator, dtype=torch.float64)).to(device=device, dtype=dtype)
    labels = torch.randint(0, shape[1], (shape[0],), generator=generator).to(device)
    return logits, labels


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("gamma, eta", [(10.0, 20.0), (1.0, 0.0), (0.0, -2.5)])
def test_matches_reference(backend, device, shape, gamma, eta):
    for seed, dtype in enumerate(dtypes_for(device)):
        logits, labels = _inputs(shape, dtype, device, seed)
        grad_out = torch.randn(shape[0], generator=torch.Generator().manual_seed(100 + seed), dtype=torch.float64).to(device)

        def outputs(which, logits, grad_out):
            x = logits.detach().requires_grad_()
            out = run(which, cal_objective, x, labels, gamma, eta)
            out.backward(grad_out.to(out.dtype))
            return out, x.grad

        truth = outputs("reference", logits.double(), grad_out)
        names = ("objective", "grad_logits")
        assert_outputs_match(names, outputs(backend, logits, grad_out), outputs("reference", logits, grad_out), truth, dtype)


def test_noncontiguous_and_int32_labels(backend, device):
    logits, labels = _inputs((6, 4), torch.float32, device, 3)
    expected = run("reference", cal_objective, logits, labels, 2.0, 3.0)
    got = run(backend, cal_objective, noncontiguous(logits), labels.int(), 2.0, 3.0)
    torch.testing.assert_close(got, expected)


def test_gradcheck(backend, device):
    if device != "cpu":
        pytest.skip("float64 gradcheck runs on the CPU")
    logits, labels = _inputs((4, 5), torch.float64, device, 9)
    logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda z: run(backend, cal_objective, z, labels, 10.0, 20.0), (logits,))


def test_double_backward_raises(backend, device):
    logits, labels = _inputs((4, 3), torch.float32, device, 1)
    logits.requires_grad_()
    out = run(backend, cal_objective, logits, labels, 1.0, 1.0).sum()
    (grad,) = torch.autograd.grad(out, logits, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        grad.sum().backward()


def test_opcheck(backend, device):
    logits, labels = _inputs((4, 3), torch.float32, device, 2)
    kernels = cat_fast.ops.registry.kernels(backend)
    torch.library.opcheck(kernels.cal_objective_forward.default, (logits.requires_grad_(), labels, 10.0, 20.0))
    grad = torch.randn(4, device=device)
    torch.library.opcheck(kernels.cal_objective_backward.default, (grad, logits.detach(), labels, 10.0, 20.0))


@pytest.mark.parametrize(
    "logits, labels, error, words",
    [
        (torch.randn(3), torch.tensor([0, 1, 0]), ValueError, "logits: expected a 2-D"),
        (torch.randn(3, 2), torch.tensor([0, 1]), ValueError, "labels: expected size 3"),
        (torch.randn(3, 2), torch.tensor([0, 2, 1]), ValueError, "labels: expected values in [0, 2)"),
        (torch.randn(3, 2), torch.tensor([0.0, 1.0, 0.0]), TypeError, "labels: expected dtype"),
        (torch.randn(3, 2).long(), torch.tensor([0, 1, 0]), TypeError, "logits: expected dtype"),
    ],
)
def test_bad_input_names_the_argument(logits, labels, error, words):
    with pytest.raises(error) as caught:
        cal_objective(logits, labels, 1.0, 1.0)
    assert words in str(caught.value)
    with pytest.raises(TypeError, match="gamma: expected a number"):
        cal_objective(torch.randn(3, 2), torch.tensor([0, 1, 0]), "10", 1.0)
