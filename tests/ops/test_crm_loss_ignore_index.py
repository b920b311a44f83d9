"""crm_loss with ignored rows (ignore_index): against the reference and F.cross_entropy, at batch sizes of
several blocks, gradcheck and opcheck, and the kernels' default ignore_index."""
import pytest
import torch

import cat_fast
from cat_fast.ops import crm_loss

from .conftest import assert_outputs_match, dtypes_for, run, tolerance, with_ignored
from .test_crm_loss import _few_triton_programs, _inputs


@pytest.mark.parametrize("shape", [(1, 2), (8, 3), (4, 130)], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("detach_weight", [True, False])
@pytest.mark.parametrize("pattern", ["some", "all"])
def test_ignore_index_matches_reference(backend, device, shape, reduction, detach_weight, pattern):
    for seed, dtype in enumerate(dtypes_for(device)):
        logits, cf_logits, labels = _inputs(shape, dtype, device, 50 + seed)
        labels = with_ignored(labels, pattern)
        grad_out = torch.randn(shape[0] if reduction == "none" else (), generator=torch.Generator().manual_seed(seed),
                               dtype=torch.float64).to(device)

        def outputs(which, logits, cf_logits):
            z = logits.detach().requires_grad_()
            z_cf = cf_logits.detach().requires_grad_()
            out = run(which, crm_loss, z, z_cf, labels, 0.5, 2.0, detach_weight, reduction)
            out.backward(grad_out.to(out.dtype))
            grad_cf = z_cf.grad if z_cf.grad is not None else torch.zeros_like(z_cf)
            return out, z.grad, grad_cf

        got = outputs(backend, logits, cf_logits)
        kept = labels != -100
        if reduction == "mean" and not kept.any():  # every row ignored: NaN, like F.cross_entropy; zero gradients
            truth = outputs("reference", logits.double(), cf_logits.double())
            assert got[0].isnan() and truth[0].isnan()
            assert not got[1].any() and not got[2].any()
            continue
        truth = outputs("reference", logits.double(), cf_logits.double())
        names = ("loss", "grad_logits", "grad_cf_logits")
        assert_outputs_match(names, got, outputs("reference", logits, cf_logits), truth, dtype)
        assert not got[1][~kept].any() and not got[2][~kept].any()  # ignored rows: exactly zero gradients
        if reduction == "none":
            assert not got[0][~kept].any()


def test_mean_matches_cross_entropy_with_ignored_rows(backend, device):
    """A weight clipped to 1 (a1 = a2 = 1) leaves the CE: its mean over the non-ignored rows is F.cross_entropy's."""
    logits, cf_logits, labels = _inputs((10, 4), torch.float64 if device == "cpu" else torch.float32, device, 3)
    labels = with_ignored(labels, "some")
    for reduction in ("mean", "sum"):
        got = run(backend, crm_loss, logits, cf_logits, labels, 1.0, 1.0, True, reduction)
        expected = torch.nn.functional.cross_entropy(logits, labels, reduction=reduction)
        torch.testing.assert_close(got, expected.to(got.dtype))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_large_batch_with_ignored_rows_matches_reference(backend, device, reduction, monkeypatch):
    """The multi-block / multi-program mean and sum with ignored rows (the mean divides by the count of the others,
    added up like the partial sums), and the mean's backward, whose blocks each count the kept labels."""
    _few_triton_programs(backend, device, monkeypatch)
    shapes = [(5000, 3)] if device == "cpu" else [(600_000, 3), (3000, 300)]
    for shape in shapes:
        logits, cf_logits, labels = _inputs(shape, torch.float32, device, 31)
        labels[torch.arange(shape[0], device=device) % 7 == 2] = -100
        z = logits.detach().requires_grad_()
        got = run(backend, crm_loss, z, cf_logits, labels, 0.5, 2.0, True, reduction)
        got.backward()
        z_ref = logits.double().requires_grad_()
        truth = run("reference", crm_loss, z_ref, cf_logits.double(), labels, 0.5, 2.0, True, reduction)
        truth.backward()
        torch.testing.assert_close(got.double(), truth.detach(), **tolerance(torch.float32))
        torch.testing.assert_close(z.grad.double(), z_ref.grad, **tolerance(torch.float32))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradcheck_with_ignored_rows(backend, device, reduction):
    if device != "cpu":
        pytest.skip("float64 gradcheck runs on the CPU")
    logits, cf_logits, labels = _inputs((6, 3), torch.float64, device, 16)
    labels = with_ignored(labels, "some")
    logits.requires_grad_()
    cf_logits.requires_grad_()

    def fn(z, z_cf):
        return run(backend, crm_loss, z, z_cf, labels, 0.0, 10.0, False, reduction)

    assert torch.autograd.gradcheck(fn, (logits, cf_logits))


def test_opcheck_with_ignore_index(backend, device):
    logits, cf_logits, labels = _inputs((5, 3), torch.float32, device, 2)
    labels[3] = 7  # ignore_index = 7 below
    kernels = cat_fast.ops.registry.kernels(backend)
    for reduction in (0, 1, 2):
        torch.library.opcheck(
            kernels.crm_loss_forward.default,
            (logits.detach().requires_grad_(), cf_logits.detach().requires_grad_(), labels, 0.0, 10.0, reduction,
             False, 7),
        )
    _, stats = kernels.crm_loss_forward(logits, cf_logits, labels, 0.0, 10.0, 0, False, 7)
    for reduction, grad in ((0, torch.randn(5, device=device)), (1, torch.randn((), device=device))):
        args = (grad, logits, cf_logits, labels, stats, 0.0, 10.0, reduction, False, 7)
        torch.library.opcheck(kernels.crm_loss_backward.default, args)
        grad_logits, grad_cf = kernels.crm_loss_backward(*args)
        assert not grad_logits[3].any() and not grad_cf[3].any() and stats[3, 1] == 0


def test_kernel_schemas_default_ignore_index_to_minus_100(backend, device):
    """ignore_index is last in the schemas, with a default: callers of the earlier schemas keep working."""
    logits, cf_logits, labels = _inputs((4, 3), torch.float32, device, 3)
    labels[2] = -100
    kernels = cat_fast.ops.registry.kernels(backend)
    loss, stats = kernels.crm_loss_forward(logits, cf_logits, labels, 0.0, 10.0, 1, True)
    loss_explicit, _ = kernels.crm_loss_forward(logits, cf_logits, labels, 0.0, 10.0, 1, True, -100)
    torch.testing.assert_close(loss, loss_explicit)
    torch.testing.assert_close(loss, (stats[:, 0] * stats[:, 1]).sum() / 3)
