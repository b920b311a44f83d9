"""cat_fast.kernels.triton.pooled_gs_loss (the pooled GS loss of a linear head in one kernel) against the composite of
`cat_fast.gs`. On the CPU the kernel runs under Triton's interpreter."""
import os

import pytest
import torch

pytest.importorskip("triton")
from cat_fast.kernels.triton import pooled_gs_loss as pgl  # noqa: E402
from tests.conftest import tiny_batch, tiny_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_kernel = pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _case(B, D, C, x_dtype, w_dtype=torch.float32, seed=0, none_every=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g).to(x_dtype)
    weight = torch.randn(C, D, generator=g).to(w_dtype)
    labels = torch.randint(0, C, (B,), generator=g)
    pairs = torch.randperm(B, generator=g)
    pairs[::none_every] = -1  # rows without a partner
    return [t.to(DEVICE) for t in (weight, x, pairs, labels)]


def _check(got, want, x_dtype):
    loss, count, grad_w = got
    w_loss, w_count, w_grad = want
    assert count.item() == w_count.item()
    tol = 1e-5 if x_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(loss, w_loss.float(), rtol=tol, atol=tol)
    scale = w_grad.abs().max().item() + 1e-30
    torch.testing.assert_close(grad_w.float() / scale, w_grad.float() / scale, rtol=0, atol=tol * 4)


# (B, D, C): one row, odd width, BERT width with 2 and 5 classes, a width that is not a power of two
SHAPES = [(1, 16, 2), (7, 33, 2), (16, 768, 2), (9, 768, 5), (12, 1000, 3)]


@needs_kernel
@pytest.mark.parametrize("B,D,C", SHAPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_the_composite(B, D, C, x_dtype):
    weight, x, pairs, labels = _case(B, D, C, x_dtype)
    _check(pgl._launch(weight, x, pairs, labels, 1e-8), pgl.reference(weight, x, pairs, labels), x_dtype)


@needs_kernel
def test_no_counterfactual_pair_gives_zero_loss_and_gradient():
    weight, x, pairs, labels = _case(6, 40, 2, torch.float32)
    labels = torch.zeros_like(labels)  # every partner has the same label
    loss, count, grad_w = pgl._launch(weight, x, pairs, labels, 1e-8)
    assert loss.item() == 0.0 and count.item() == 0.0
    assert torch.count_nonzero(grad_w).item() == 0


@needs_kernel
def test_strided_rows_and_a_zero_class_row():
    weight, x, pairs, labels = _case(10, 64, 3, torch.float32, seed=4)
    wide = torch.randn(10, 160, device=DEVICE)
    wide[:, 5:69] = x  # x as a view with row stride 160
    weight[1] = 0.0  # g = 0: cosine 0, the norm clamped at eps
    got = pgl._launch(weight, wide[:, 5:69], pairs, labels, 1e-8)
    _check(got, pgl.reference(weight, x, pairs, labels), torch.float32)
    _check(pgl._launch(weight[:, ::2], x[:, ::2], pairs, labels, 1e-8),
           pgl.reference(weight[:, ::2].contiguous(), x[:, ::2].contiguous(), pairs, labels), torch.float32)


@needs_kernel
def test_weight_with_a_row_stride():
    # W as a view with row stride 100 > D: the gradient is still written as a contiguous [C, D].
    weight, x, pairs, labels = _case(8, 40, 3, torch.float32, seed=6)
    wide = torch.randn(3, 100, device=DEVICE)
    wide[:, 7:47] = weight
    got = pgl._launch(wide[:, 7:47], x, pairs, labels, 1e-8)
    assert got[2].is_contiguous()
    _check(got, pgl.reference(weight, x, pairs, labels), torch.float32)


@needs_kernel
def test_the_check_fails_on_a_wrong_kernel():
    # The comparison above can fail: a loss off by one row's term, or a gradient of the wrong class row, is caught.
    weight, x, pairs, labels = _case(16, 768, 2, torch.float32)
    loss, count, grad_w = pgl._launch(weight, x, pairs, labels, 1e-8)
    want = pgl.reference(weight, x, pairs, labels)
    with pytest.raises(AssertionError):
        _check((loss * 1.01, count, grad_w), want, torch.float32)
    with pytest.raises(AssertionError):
        _check((loss, count, grad_w.flip(0)), want, torch.float32)


@needs_cuda
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_autograd_wrapper_gives_the_weight_gradient(x_dtype):
    weight, x, pairs, labels = _case(16, 768, 3, x_dtype)
    assert pgl.supported(weight, x)
    w = weight.clone().requires_grad_(True)
    loss, count = pgl.pooled_gs_loss(w, x, pairs, labels)
    (3.0 * loss).backward()
    want = pgl.reference(weight, x, pairs, labels)
    _check((loss.detach(), count, w.grad / 3.0), want, x_dtype)
    assert not count.requires_grad


def test_supported_only_for_cuda_and_small_floats():
    weight, x, _, _ = (t.cpu() for t in _case(4, 16, 2, torch.float32))
    assert not pgl.supported(weight, x)  # the CPU runs the composite
    if torch.cuda.is_available():
        assert pgl.supported(weight.cuda(), x.cuda())
        assert not pgl.supported(weight.cuda().double(), x.cuda().double())
        assert not pgl.supported(weight.cuda(), x.cuda()[:, :8])


@needs_cuda
@pytest.mark.parametrize("autocast", [False, True])
def test_gradient_supervision_takes_the_kernel_with_the_same_step(autocast, monkeypatch):
    # From its second call, GS pooled exact on CUDA runs the kernel: the same loss and parameter gradients as the
    # composite (the kernel switched off), with dropout, in fp32 and under bf16 autocast.
    import cat_fast
    from cat_fast.objectives import gs as gs_module

    results = []
    for kernel in (True, False):
        torch.manual_seed(0)
        model = tiny_model("bert", num_layers=2, hidden_dropout_prob=0.2).cuda().train()
        gs = cat_fast.GradientSupervision(model, representation="pooled", mode="exact")
        batch = {k: v.cuda() for k, v in tiny_batch("bert", batch=8).items()}
        pairs = torch.tensor([1, 0, 3, 2, 5, 4, -1, 6], device="cuda")
        calls = []
        if kernel:
            real = pgl.pooled_gs_loss
            monkeypatch.setattr(pgl, "pooled_gs_loss", lambda *a: calls.append(1) or real(*a))
        else:
            monkeypatch.setattr(gs_module, "_fused_kernel", lambda: None)
        for step in range(2):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(10 + step)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss, info = gs(batch, pairs)
            loss.backward()
        assert len(calls) == (1 if kernel else 0)
        grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        results.append((loss.detach(), info["gs_loss"], info["gs_pairs"], grads))
        monkeypatch.undo()
    (loss_k, gs_k, pairs_k, grads_k), (loss_c, gs_c, pairs_c, grads_c) = results
    tol = 2e-3 if autocast else 1e-5
    torch.testing.assert_close(gs_k, gs_c, rtol=tol, atol=tol)
    torch.testing.assert_close(loss_k, loss_c, rtol=tol, atol=tol)
    assert pairs_k.item() == pairs_c.item()
    for a, b in zip(grads_k, grads_c):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
