"""Every op traces under torch.compile (first order) on every fused backend and matches eager reference values and gradients."""
import torch

import cat_fast
from cat_fast.ops import cal_objective, cal_step_, cmix, crm_loss, gs_cosine_loss

from .conftest import run


def _step(h, lam, partner, logits, cf_logits, labels, g, g_hat):
    h_mix, _ = cmix(h, lam, partner)
    objective = cal_objective(logits, labels, 10.0, 20.0).sum()
    risk = crm_loss(logits, cf_logits, labels, 0.0, 10.0, False, "mean")
    supervision = gs_cosine_loss(g, g_hat)
    return h_mix.square().mean() + objective + risk + supervision


def _inputs(device):
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device).requires_grad_()

    partner = torch.tensor([2, 0, 0], device=device)
    labels = torch.tensor([1, 0, 2], device=device)
    return rand(3, 4, 8), torch.rand(3, generator=generator).to(device).requires_grad_(), partner, rand(3, 3), rand(3, 3), labels, rand(3, 8), rand(3, 8)


def test_all_ops_under_torch_compile(backend, device):
    args = _inputs(device)
    differentiable = [a for a in args if a.requires_grad]

    def compiled_step(*inputs):
        return run(backend, _step, *inputs)

    loss = torch.compile(compiled_step)(*args)
    grads = torch.autograd.grad(loss, differentiable)
    expected = run("reference", _step, *args)
    expected_grads = torch.autograd.grad(expected, differentiable)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

    lam = torch.rand(3, 5, device=device)
    grad = torch.randn(3, 5, device=device)
    expected_lam = run("reference", cal_step_, lam.clone(), grad, 0.1, 2.0, 0.0, 1.0)
    compiled_lam = lam.clone()
    torch.compile(lambda x, g: run(backend, cal_step_, x, g, 0.1, 2.0, 0.0, 1.0))(compiled_lam, grad)
    torch.testing.assert_close(compiled_lam, expected_lam)


def _step_ignore(h, lam, partner, logits, cf_logits, labels, g, g_hat):
    h_mix, _ = cmix(h, lam, partner)
    h_half, _ = cmix(h, 0.25, partner)
    objective = cal_objective(logits, labels, reduction="mean") + cal_objective(logits, labels, 1.0, 2.0, "sum")
    risk = crm_loss(logits, cf_logits, labels, 0.0, 10.0, False, "mean") + crm_loss(logits, cf_logits, labels,
                                                                                    reduction="none").sum()
    return h_mix.square().mean() + h_half.mean() + objective + risk + gs_cosine_loss(g, g_hat)


def test_ignore_index_reductions_and_broadcast_lambda_under_torch_compile(backend, device):
    h, _, partner, logits, cf_logits, labels, g, g_hat = _inputs(device)
    lam = torch.rand(3, 1, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()  # [B, 1] lambda
    labels = torch.tensor([1, -100, 2], device=device)
    args = (h, lam, partner, logits, cf_logits, labels, g, g_hat)
    differentiable = [a for a in args if a.requires_grad]
    loss = torch.compile(lambda *inputs: run(backend, _step_ignore, *inputs))(*args)
    grads = torch.autograd.grad(loss, differentiable)
    expected = run("reference", _step_ignore, *args)
    expected_grads = torch.autograd.grad(expected, differentiable)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert grads[1].shape == (3, 1)
    assert not grads[2][1].any()  # logits: the ignored row gets no gradient


def test_opcheck_of_the_schemas_with_ignore_index(backend, device):
    """opcheck (schema, fake, autograd registration, torch.compile) of the kernel ops whose schemas gained
    `int ignore_index=-100`: with ignored rows, an explicit ignore_index and the default."""
    kernels = cat_fast.ops.registry.kernels(backend)
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 3, generator=generator).to(device)
    cf_logits = torch.randn(5, 3, generator=generator).to(device)
    for ignore_index, extra in ((-100, ()), (-100, (-100,)), (2, (2,))):
        labels = torch.tensor([0, ignore_index, 1, 2 if ignore_index != 2 else 0, ignore_index], device=device)
        z = logits.detach().requires_grad_()
        torch.library.opcheck(kernels.cal_objective_forward.default, (z, labels, 10.0, 20.0, *extra))
        torch.library.opcheck(kernels.cal_objective_backward.default,
                              (torch.randn(5, device=device), logits, labels, 10.0, 20.0, *extra))
        for reduction in (0, 1, 2):
            zc = cf_logits.detach().requires_grad_()
            torch.library.opcheck(kernels.crm_loss_forward.default,
                                  (z, zc, labels, 0.0, 10.0, reduction, False, *extra))
            _, stats = kernels.crm_loss_forward(logits, cf_logits, labels, 0.0, 10.0, reduction, False, *extra)
            grad = torch.randn(5 if reduction == 0 else (), device=device)
            torch.library.opcheck(kernels.crm_loss_backward.default,
                                  (grad, logits, cf_logits, labels, stats, 0.0, 10.0, reduction, False, *extra))
