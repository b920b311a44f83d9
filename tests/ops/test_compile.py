"""Every op traces under torch.compile (first order) on every fused backend and matches eager reference values and gradients."""
import torch

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
