"""cat_fast.kernels.triton.gelu_bias_backward (GELU backward + the bias gradient, for `layers.training`) against its
PyTorch reference, and the reference against autograd. On the CPU the Triton kernels run under the interpreter."""
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from cat_fast.kernels.triton import gelu_bias_backward as gelu  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _inputs(n, N, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    inner = (torch.randn(n, N, generator=g) * 3).to(dtype)
    grad = torch.randn(n, N, generator=g).to(dtype)
    return grad.to(DEVICE), inner.to(DEVICE)


@pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("n,N", [(1, 7), (37, 300), (64, 256), (5, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("want_bias", [True, False])
def test_kernel_matches_the_reference(n, N, dtype, want_bias):
    grad, inner = _inputs(n, N, dtype)
    got, got_bias = gelu.backward(grad, inner, want_bias)
    want, want_bias_grad = gelu.reference_backward(grad, inner, want_bias)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # 16-bit: one rounding step apart at most
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if want_bias:
        assert got_bias.dtype == torch.float32 and got_bias.shape == (N,)
        # the sum of what was written, rounded as written (rows summed in another order than the reference)
        torch.testing.assert_close(got_bias, got.float().sum(0), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got_bias, want_bias_grad, rtol=1e-2 if tol > 1e-5 else 1e-5,
                                   atol=tol * n ** 0.5)
    else:
        assert got_bias is None


@pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("block_m,block_n,per_sm", [(8, 128, 1), (32, 64, 0.34), (16, 256, 8)])
@pytest.mark.parametrize("tile_sums", [False, True])
def test_launch_settings_give_the_same_results(block_m, block_n, per_sm, tile_sums):
    grad, inner = _inputs(77, 300, torch.bfloat16, seed=3)
    want, _ = gelu.backward(grad, inner, want_bias=False)
    got, got_bias = gelu.backward(grad, inner, block_m=block_m, block_n=block_n, per_sm=per_sm, tile_sums=tile_sums)
    assert torch.equal(got, want)  # elementwise: the same bits under any tiling
    torch.testing.assert_close(got_bias, got.float().sum(0), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
def test_non_contiguous_inputs_nan_and_empty():
    grad, inner = _inputs(12, 40, torch.bfloat16, seed=1)
    grad_t, inner_t = grad.t().contiguous().t(), inner.t().contiguous().t()  # same values, column-major
    assert not grad_t.is_contiguous()
    got, got_bias = gelu.backward(grad_t, inner_t)
    want, _ = gelu.reference_backward(grad, inner)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    inner[3, 5] = float("nan")
    got, got_bias = gelu.backward(grad, inner)
    assert got[3, 5].isnan() and got_bias[5].isnan() and torch.isfinite(got_bias[torch.arange(40) != 5]).all()
    empty, empty_bias = gelu.backward(grad[:0], inner[:0])
    assert empty.shape == (0, 40) and torch.equal(empty_bias, torch.zeros(40, device=DEVICE))
    with pytest.raises(ValueError, match="grad, inner"):
        gelu.backward(grad, inner[:, :3])


def test_reference_is_autograd_of_gelu_and_the_bias():
    # float64: the reference's input gradient and bias gradient are autograd's for gelu(x @ W.T + b)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 5, generator=g, dtype=torch.float64)
    w = torch.randn(6, 5, generator=g, dtype=torch.float64)
    b = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    inner = (x @ w.t() + b)
    upstream = torch.randn(9, 6, generator=g, dtype=torch.float64)
    (want_bias,) = torch.autograd.grad(F.gelu(inner), b, upstream, retain_graph=True)
    (want,) = torch.autograd.grad(F.gelu(inner), inner, upstream)
    got, got_bias = gelu.reference_backward(upstream, inner.detach())
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_bias.double(), want_bias, rtol=1e-6, atol=1e-6)  # the reference sums in fp32
