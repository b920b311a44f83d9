import inspect

import pytest
import torch

import cat_fast
from cat_fast.ops import cal_objective

from .conftest import assert_outputs_match, dtypes_for, noncontiguous, run, tolerance, with_ignored, without_ties

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


def test_defaults_are_the_papers():
    logits, labels = _inputs((5, 3), torch.float64, "cpu", 21)
    torch.testing.assert_close(cal_objective(logits, labels), cal_objective(logits, labels, 10.0, 20.0))
    signature = inspect.signature(cal_objective)
    assert signature.parameters["gamma"].default == 10.0 and signature.parameters["eta"].default == 20.0
    assert signature.parameters["reduction"].default == "none"
    assert signature.parameters["ignore_index"].default == -100


@pytest.mark.parametrize("shape", [(1, 2), (7, 3), (5, 130)], ids=str)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("pattern", ["none", "some", "all"])
@pytest.mark.parametrize("ignore_index", [-100, 1], ids=["ii-100", "ii1"])
def test_ignore_index_and_reductions_match_reference(backend, device, shape, reduction, pattern, ignore_index):
    for seed, dtype in enumerate(dtypes_for(device)):
        logits, labels = _inputs(shape, dtype, device, 40 + seed)
        labels = with_ignored(labels, pattern, ignore_index)
        grad_out = torch.randn(shape[0] if reduction == "none" else (), generator=torch.Generator().manual_seed(seed),
                               dtype=torch.float64).to(device)

        def outputs(which, logits):
            x = logits.detach().requires_grad_()
            out = run(which, cal_objective, x, labels, 10.0, 20.0, reduction, ignore_index)
            out.backward(grad_out.to(out.dtype))
            return out, x.grad

        got = outputs(backend, logits)
        truth = outputs("reference", logits.double())
        kept = (labels != ignore_index).to(device)
        if reduction == "mean" and not kept.any():  # every row ignored: NaN, like F.cross_entropy; zero gradient
            assert got[0].isnan() and truth[0].isnan()
            assert torch.equal(got[1], torch.zeros_like(got[1]))
            continue
        assert_outputs_match(("objective", "grad_logits"), got, outputs("reference", logits), truth, dtype)
        assert (got[1][~kept] == 0).all()  # ignored rows: exactly zero gradient
        if reduction == "none":
            assert (got[0][~kept] == 0).all()


def test_mean_matches_cross_entropy_with_ignored_rows(backend, device):
    """gamma = 1, eta = 0: the objective is CE, and its mean is F.cross_entropy's (same ignore_index convention)."""
    logits, labels = _inputs((9, 4), torch.float64 if device == "cpu" else torch.float32, device, 5)
    labels = with_ignored(labels, "some", -100)
    got = run(backend, cal_objective, logits, labels, 1.0, 0.0, "mean")
    torch.testing.assert_close(got, torch.nn.functional.cross_entropy(logits, labels).to(got.dtype))
    got = run(backend, cal_objective, logits, labels, 1.0, 0.0, "sum")
    torch.testing.assert_close(got, torch.nn.functional.cross_entropy(logits, labels, reduction="sum").to(got.dtype))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_gradcheck_with_ignored_rows(backend, device, reduction):
    if device != "cpu":
        pytest.skip("float64 gradcheck runs on the CPU")
    logits, labels = _inputs((5, 4), torch.float64, device, 19)
    labels = with_ignored(labels, "some", -100)
    logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda z: run(backend, cal_objective, z, labels, 10.0, 20.0, reduction), (logits,))


TIES = [[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 5.0, -1.0, 5.0]]


@pytest.mark.parametrize("wide", [False, True], ids=["C4", "C3000"])
def test_tied_maxima_give_the_first_index_the_phi_gradient(backend, device, wide):
    """Phi = max softmax has many subgradients where the top logit is tied: every backend (and the reference)
    gives Phi's gradient to the FIRST tied index, like torch.argmax. Wide rows put the tied entries in different
    Triton chunks / CUDA threads."""
    for dtype in dtypes_for(device):
        if wide:
            logits = torch.zeros(2, 3000, dtype=torch.float64)
            logits[0, 100] = logits[0, 2500] = 4.0
            logits[1, 2100] = logits[1, 2999] = 3.0
            logits[1, 7] = 1.0
        else:
            logits = torch.tensor(TIES, dtype=torch.float64)
        logits = logits.to(device=device, dtype=dtype)
        labels = torch.zeros(logits.shape[0], dtype=torch.long, device=device)
        grads = {}
        for which in ("reference", backend):
            x = logits.detach().requires_grad_()
            run(which, cal_objective, x, labels, 10.0, 20.0).sum().backward()
            grads[which] = x.grad
        z = logits.double()
        p = z.softmax(-1)
        first = torch.nn.functional.one_hot(z.argmax(-1), z.shape[1]).double()
        expected = 10.0 * (p - torch.nn.functional.one_hot(labels.cpu(), z.shape[1]).to(p)) + \
            20.0 * p.amax(-1, keepdim=True) * (first - p)
        tol = tolerance(dtype)
        torch.testing.assert_close(grads["reference"].double(), expected, **tol)
        torch.testing.assert_close(grads[backend].double(), expected, **tol)
        torch.testing.assert_close(grads[backend], grads["reference"].to(grads[backend].dtype), **tol)


def test_opcheck_with_ignore_index(backend, device):
    logits, labels = _inputs((5, 3), torch.float32, device, 2)
    labels[3] = 7
    kernels = cat_fast.ops.registry.kernels(backend)
    torch.library.opcheck(kernels.cal_objective_forward.default, (logits.requires_grad_(), labels, 10.0, 20.0, 7))
    grad = torch.randn(5, device=device)
    torch.library.opcheck(kernels.cal_objective_backward.default, (grad, logits.detach(), labels, 10.0, 20.0, 7))
    out = kernels.cal_objective_forward(logits.detach(), labels, 10.0, 20.0, 7)
    assert out[3] == 0 and bool((out[[0, 1, 2, 4]] != 0).all())
    grad_logits = kernels.cal_objective_backward(grad, logits.detach(), labels, 10.0, 20.0, 7)
    assert bool((grad_logits[3] == 0).all())


def test_kernel_schemas_default_ignore_index_to_minus_100(backend, device):
    """ignore_index is last in the schemas, with a default: callers of the earlier schemas keep working."""
    logits, labels = _inputs((4, 3), torch.float32, device, 3)
    kernels = cat_fast.ops.registry.kernels(backend)
    torch.testing.assert_close(kernels.cal_objective_forward(logits, labels, 1.0, 2.0),
                               kernels.cal_objective_forward(logits, labels, 1.0, 2.0, -100))
    labels[0] = -100
    assert kernels.cal_objective_forward(logits, labels, 1.0, 2.0)[0] == 0


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(labels=torch.tensor([0, -100, 1])), None, None),
        (dict(labels=torch.tensor([0, -5, 1])), ValueError, "labels: expected values in [0, 2) (class indices of logits) or ignore_index=-100"),
        (dict(labels=torch.tensor([0, 2, 1]), ignore_index=2), None, None),
        (dict(labels=torch.tensor([0, -100, 1]), ignore_index=2), ValueError, "labels: expected values in [0, 2)"),
        (dict(ignore_index=1.5), TypeError, "ignore_index: expected an int"),
        (dict(ignore_index=True), TypeError, "ignore_index: expected an int"),
        (dict(ignore_index=2**70), ValueError, "ignore_index: expected an int64"),
        (dict(reduction="avg"), ValueError, "reduction: expected one of"),
        (dict(labels=torch.tensor([-100, -100, -100]), reduction="mean"), None, None),
    ],
)
def test_ignore_index_and_reduction_arguments(kwargs, error, words):
    args = dict(logits=torch.randn(3, 2), labels=torch.tensor([0, 1, 1]))
    args.update(kwargs)
    for backend in ("reference", "cpp"):
        if error is None:
            run(backend, cal_objective, **args)
            continue
        with pytest.raises(error) as caught:
            run(backend, cal_objective, **args)
        assert words in str(caught.value)


@pytest.mark.parametrize("where", ["first", "last", "row"])
def test_a_nan_logit_gives_nan_as_the_reference(backend, device, where):
    # A NaN first in a kernel thread's slice of the row was dropped by the CUDA softmax state (its row came out
    # finite); the reference, torch's softmax, gives NaN for the whole row.
    logits, labels = _inputs((4, 5), torch.float32, device, 0)
    cols = {"first": [0], "last": [4], "row": list(range(5))}[where]
    logits[2, cols] = float("nan")
    want = run("reference", cal_objective, logits, labels, 10.0, 20.0)
    got = run(backend, cal_objective, logits, labels, 10.0, 20.0)
    assert bool(got[2].isnan()) and torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-5, atol=1e-5)
