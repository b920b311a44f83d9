"""The training API on a CUDA device: the fused GPU backends give the same step as the reference ops."""
import pytest
import torch

import cat_fast
from tests.conftest import tiny_batch, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gpu_backends():
    return [b for b in ("cuda", "triton") if b in cat_fast.backends()]


def _cat_step(backend, arch, adv_steps, gs_weight=0.0):
    model = tiny_model(arch, num_layers=4).cuda().eval()
    batch = {k: v.cuda() for k, v in tiny_batch(arch, batch=6, length=11).items()}
    cat = cat_fast.CAT(model, layers=[2], adv_steps=adv_steps, gs_weight=gs_weight, generator=torch.Generator().manual_seed(5))
    with cat_fast.use_backend(backend):
        loss, info = cat(batch)
        loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return loss.detach(), {k: float(v) for k, v in info.items()}, grads


@pytest.mark.parametrize("arch", ["bert", "deberta-v2"])
@pytest.mark.parametrize("adv_steps, gs_weight", [(3, 0.0), (0, 0.0), (3, 1.0)], ids=["cat", "cat-star", "cat-gs"])
def test_cat_step_matches_reference_backend(arch, adv_steps, gs_weight):
    expected_loss, expected_info, expected_grads = _cat_step("reference", arch, adv_steps, gs_weight)
    assert expected_grads.abs().sum() > 0
    for backend in _gpu_backends():
        loss, info, grads = _cat_step(backend, arch, adv_steps, gs_weight)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-4, atol=1e-5, msg=lambda m, b=backend: f"{b}: {m}")
        assert info.keys() == expected_info.keys()
        for key in expected_info:
            assert info[key] == pytest.approx(expected_info[key], rel=1e-3, abs=1e-5), (backend, key)
        torch.testing.assert_close(grads, expected_grads, rtol=1e-3, atol=1e-5, msg=lambda m, b=backend: f"{b}: {m}")


@pytest.mark.parametrize("mode, dtype", [("exact", torch.float32), ("exact", torch.float64),
                                         ("first_order", torch.float64)])
def test_gradient_supervision_step_matches_reference_backend(mode, dtype):
    """fp32 for the exact double backward; float64 for both modes. The first-order step differentiates a difference
    quotient, which divides the backends' rounding by its step: in fp32 the cpp and reference backends differ by 1.4x
    rtol 1e-3 on the CPU, in float64 by 2e-13 (the arithmetic, not the rounding, is what this compares)."""
    def step(backend):
        model = tiny_model("bert", num_layers=3, num_labels=2).to(device="cuda", dtype=dtype).eval()
        batch = {k: v.cuda() for k, v in tiny_batch("bert", batch=6, length=9, num_labels=2).items()}
        batch["labels"] = torch.tensor([0, 1, 0, 1, 0, 1], device="cuda")
        pairs = torch.tensor([1, 0, 3, 2, 5, 4], device="cuda")
        gs = cat_fast.GradientSupervision(model, representation=0, mode=mode)
        with cat_fast.use_backend(backend):
            loss, _ = gs(batch, pairs)
            loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    rtol, atol = (1e-4, 1e-5) if dtype == torch.float32 else (1e-9, 1e-12)
    grad_rtol, grad_atol = (1e-3, 1e-5) if dtype == torch.float32 else (1e-8, 1e-11)
    expected_loss, expected_grads = step("reference")
    assert expected_grads.abs().max() > 1e-3
    for backend in _gpu_backends():
        loss, grads = step(backend)
        torch.testing.assert_close(loss, expected_loss, rtol=rtol, atol=atol, msg=lambda m, b=backend: f"{b}: {m}")
        torch.testing.assert_close(grads, expected_grads, rtol=grad_rtol, atol=grad_atol,
                                   msg=lambda m, b=backend: f"{b}: {m}")
