"""cat_fast.kernels.triton.residual_layer_norm (fused residual add + LayerNorm for `resumed_layer`) against its PyTorch
reference, and the reference against autograd. On the CPU the Triton kernels run under the interpreter."""
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from cat_fast.kernels.triton import residual_layer_norm as rln  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"

# (rows shape, D): one row, odd D, a BERT width, a width that is not a power of two
SHAPES = [((1,), 32), ((3, 5), 768), ((7,), 1000), ((2, 3), 33)]


def _inputs(lead, D, branch_dtype, p=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    branch = torch.randn(*lead, D, generator=g).to(branch_dtype)
    residual = torch.randn(*lead, D, generator=g) * 2 + 1
    weight = torch.rand(D, generator=g) + 0.5
    bias = torch.randn(D, generator=g)
    keep = torch.rand(*lead, D, generator=g) > p
    grad_y = torch.randn(*lead, D, generator=g)
    return [t.to(DEVICE) for t in (branch, residual, weight, bias, keep, grad_y)]


@pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("lead,D", SHAPES)
@pytest.mark.parametrize("branch_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_keep", [True, False])
def test_kernels_match_the_reference(lead, D, branch_dtype, with_keep):
    branch, residual, weight, bias, keep, grad_y = _inputs(lead, D, branch_dtype)
    keep = keep if with_keep else None
    out16 = torch.bfloat16 if branch_dtype == torch.float32 else branch_dtype
    got = rln.forward(branch, residual, weight, bias, 1e-12, out16_dtype=out16)
    want = rln.reference_forward(branch, residual, weight, bias, 1e-12, out16_dtype=out16)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        tol = 1e-5 if g.dtype == torch.float32 else 1e-2  # 16-bit: one rounding step apart at most
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    y, _, mean, rstd = got
    got_b = rln.backward(grad_y, branch, residual, weight, mean, rstd, keep, 1 / 0.7)
    want_b = rln.reference_backward(grad_y, branch, residual, weight, mean, rstd, keep, 1 / 0.7)
    for g, w in zip(got_b, want_b):
        assert g.dtype == w.dtype and g.shape == w.shape
        tol = 1e-5 if g.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    if with_keep:
        assert torch.all(got_b[1][~keep] == 0)


@pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
def test_constant_row_and_non_contiguous_residual():
    branch, residual, weight, bias, keep, grad_y = _inputs((4, 6), 64, torch.bfloat16)
    residual = residual.transpose(0, 1).contiguous().transpose(0, 1)  # same values, another memory order
    assert not residual.is_contiguous()
    branch[1, 2] = 0
    residual[1, 2] = 3.0  # a constant row: variance 0, rstd = 1/sqrt(eps)
    y, _, mean, rstd = rln.forward(branch, residual, weight, bias, 1e-5)
    y_ref, _, mean_ref, rstd_ref = rln.reference_forward(branch, residual, weight, bias, 1e-5)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y[1, 2], bias)
    grads = rln.backward(grad_y, branch, residual, weight, mean, rstd, keep, 1.25)
    want = rln.reference_backward(grad_y, branch, residual, weight, mean_ref, rstd_ref, keep, 1.25)
    torch.testing.assert_close(grads[0], want[0], rtol=1e-4, atol=1e-4)
    assert torch.isfinite(grads[0]).all()


def test_reference_is_layer_norm_and_its_gradient():
    # float64: the reference forward is F.layer_norm of the sum, and its backward is autograd's gradient of it
    lead, D = (3, 5), 40
    g = torch.Generator().manual_seed(3)
    branch = torch.randn(*lead, D, generator=g, dtype=torch.float64, requires_grad=True)
    residual = torch.randn(*lead, D, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.rand(D, generator=g, dtype=torch.float64) + 0.5
    bias = torch.randn(D, generator=g, dtype=torch.float64)
    keep = torch.rand(*lead, D, generator=g) > 0.25
    grad_y = torch.randn(*lead, D, generator=g, dtype=torch.float64)
    scale = 1 / 0.75
    dropped = torch.where(keep, branch * scale, 0.0)
    y_ref = F.layer_norm(dropped + residual, (D,), weight, bias, 1e-6)
    grad_dropped, grad_residual = torch.autograd.grad(y_ref, (dropped, residual), grad_y)
    (grad_branch,) = torch.autograd.grad(dropped, branch, grad_dropped)
    y, _, mean, rstd = rln.reference_forward(dropped.detach(), residual.detach(), weight, bias, 1e-6)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    grad_s, grad_b = rln.reference_backward(grad_y, dropped.detach(), residual.detach(), weight, mean, rstd, keep,
                                            scale)
    torch.testing.assert_close(grad_s, grad_residual, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_b, grad_branch, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("lead,D", SHAPES + [((37,), 48)])
@pytest.mark.parametrize("branch_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_keep", [True, False])
def test_backward_with_params_matches_the_reference(lead, D, branch_dtype, with_keep):
    # 37 rows: not a multiple of the rows per program, so the last program's run is short
    branch, residual, weight, bias, keep, grad_y = _inputs(lead, D, branch_dtype, seed=5)
    keep = keep if with_keep else None
    _, _, mean, rstd = rln.forward(branch, residual, weight, bias, 1e-12)
    got = rln.backward_with_params(grad_y, branch, residual, weight, mean, rstd, keep, 1 / 0.7)
    want = rln.reference_backward_with_params(grad_y, branch, residual, weight, mean, rstd, keep, 1 / 0.7)
    plain = rln.backward(grad_y, branch, residual, weight, mean, rstd, keep, 1 / 0.7)
    assert [t.shape for t in got] == [t.shape for t in want] and [t.dtype for t in got] == [t.dtype for t in want]
    for i, (g, w) in enumerate(zip(got, want)):
        # fp32: sums over up to 37 rows in another order; 16-bit (the branch gradient, and its sums): the rounding
        # of values one fp32 rounding apart can land one 16-bit step apart
        sixteen = g.dtype != torch.float32 or (i == 4 and branch_dtype != torch.float32)
        tol = 3e-2 if sixteen else 1e-4
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=f"output {i}")
    for g, w in zip(got[:2], plain):  # the row gradients are `backward`'s, bit for bit
        assert torch.equal(g, w)
    # the branch-bias sum adds the branch gradient as rounded: exactly the rounded gradient's column sums
    torch.testing.assert_close(got[4], got[1].reshape(-1, D).float().sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("rows,min_rows", [(1, 1), (2, 3), (8, 1), (4, 16)])
@pytest.mark.parametrize("prefetch", [False, True])
def test_launch_settings_give_the_same_results(rows, min_rows, prefetch):
    # 37 rows: runs of rows that are not whole iterations; each setting sums in its own order (on a GPU a tile of
    # several rows also reduces each row in another order): the row gradients agree with `backward`'s under the
    # same tile (bit for bit) and to fp32 rounding otherwise, and the sums agree with the reference
    branch, residual, weight, bias, keep, grad_y = _inputs((37,), 48, torch.bfloat16, seed=9)
    _, _, mean, rstd = rln.forward(branch, residual, weight, bias, 1e-12)
    args = (grad_y, branch, residual, weight, mean, rstd, keep, 1 / 0.7)
    got = rln.backward_with_params(*args, rows=rows, min_rows=min_rows, per_sm=1, prefetch=prefetch)
    if prefetch:  # the same arithmetic in the same order, the loads issued an iteration early: the same bits
        for g, w in zip(got, rln.backward_with_params(*args, rows=rows, min_rows=min_rows, per_sm=1, prefetch=False)):
            assert torch.equal(g, w)
    same_tile = rln.backward(*args, rows=rows)
    for g, w in zip(got[:2], same_tile):
        assert torch.equal(g, w)
    for g, w in zip(same_tile, rln.backward(*args)):
        tol = 1e-5 if g.dtype == torch.float32 else 1e-2  # 16-bit: one rounding step apart at most
        torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol)
    want = rln.reference_backward_with_params(*args)
    for i in (2, 3):
        torch.testing.assert_close(got[i], want[i], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[4], got[1].float().sum(0), rtol=1e-5, atol=1e-5)


def test_reference_parameter_gradients_are_autograd():
    # float64: the LayerNorm weight and bias gradients and the branch-bias gradient of the reference are autograd's
    lead, D = (4, 3), 24
    g = torch.Generator().manual_seed(7)
    branch_bias = torch.randn(D, generator=g, dtype=torch.float64, requires_grad=True)
    pre = torch.randn(*lead, D, generator=g, dtype=torch.float64)
    residual = torch.randn(*lead, D, generator=g, dtype=torch.float64)
    weight = (torch.rand(D, generator=g, dtype=torch.float64) + 0.5).requires_grad_(True)
    bias = torch.randn(D, generator=g, dtype=torch.float64, requires_grad=True)
    keep = torch.rand(*lead, D, generator=g) > 0.25
    grad_y = torch.randn(*lead, D, generator=g, dtype=torch.float64)
    scale = 1 / 0.75
    branch = pre + branch_bias
    y = F.layer_norm(torch.where(keep, branch * scale, 0.0) + residual, (D,), weight, bias, 1e-6)
    want = torch.autograd.grad(y, (weight, bias, branch_bias), grad_y)
    dropped = torch.where(keep, branch * scale, 0.0).detach()
    _, _, mean, rstd = rln.reference_forward(dropped, residual, weight.detach(), bias.detach(), 1e-6)
    got = rln.reference_backward_with_params(grad_y, dropped, residual, weight.detach(), mean, rstd, keep, scale)
    for g_, w in zip(got[2:], want):
        torch.testing.assert_close(g_, w, rtol=1e-10, atol=1e-12)


def _key(value):
    return torch.tensor([value], dtype=torch.int64, device=DEVICE)


@pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("lead,D", [((1,), 32), ((3,), 33), ((2, 2), 10)])
@pytest.mark.parametrize("stream", [0, 1])
@pytest.mark.parametrize("p", [0.4, 0.7])  # thresholds below and above 2³¹: an int32 and an int64 argument
def test_dropout_mask_is_the_philox_words_of_the_documented_counters(lead, D, stream, p):
    """The kernel's keep mask equals `reference_keep` (the Philox words of each element's counters, in Python
    integers) for a key with both 32-bit halves set; another stream or key draws another mask."""
    branch, residual, weight, bias, _, _ = _inputs(lead, D, torch.bfloat16)
    key = (0x1234_5678 << 32) | 0x9ABC_DEF0
    keep = rln.forward_with_dropout(branch, residual, weight, bias, 1e-12, p, _key(key), stream)[4]
    rows = keep.numel() // D
    want = rln.reference_keep(key, rows, D, p, stream)
    assert torch.equal(keep.reshape(rows, D).cpu(), want)
    assert not torch.equal(want, rln.reference_keep(key, rows, D, p, 1 - stream))
    assert not torch.equal(want, rln.reference_keep(key + 1, rows, D, p, stream))


def _kernel_cast(x, dtype):
    """x (fp32) cast to `dtype` as the kernels cast: round to nearest even on a GPU; the interpreter truncates to
    bfloat16 (its bf16 is the fp32's high half)."""
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        return (x.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    return x.to(dtype)


@pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("lead,D", SHAPES)
@pytest.mark.parametrize("branch_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_forward_with_dropout_and_raw_backwards_match_the_reference(lead, D, branch_dtype):
    """LayerNorm(dropout(branch) + residual) with the kernel's mask: the forward and the raw backwards equal, bit
    for bit, the kernels run on the branch as the dropout writes it (the kept values scaled and cast to its dtype),
    and match the reference; the reference from the raw branch equals the reference from the dropped one."""
    branch, residual, weight, bias, _, grad_y = _inputs(lead, D, branch_dtype, seed=3)
    p, scale = 0.3, 1 / (1 - 0.3)
    out16 = torch.bfloat16 if branch_dtype == torch.float32 else branch_dtype
    y, y16, mean, rstd, keep = rln.forward_with_dropout(branch, residual, weight, bias, 1e-12, p, _key(7),
                                                        out16_dtype=out16)
    assert keep.dtype == torch.bool and keep.shape == residual.shape
    assert 0 < keep.sum() < keep.numel()
    dropped = torch.where(keep, _kernel_cast(branch.float() * scale, branch_dtype), 0).to(branch_dtype)
    for g, w in zip((y, y16, mean, rstd), rln.forward(dropped, residual, weight, bias, 1e-12, out16_dtype=out16)):
        assert torch.equal(g, w)
    want = rln.reference_forward(dropped, residual, weight, bias, 1e-12, out16_dtype=out16)
    for g, w in zip((y, y16, mean, rstd), want):
        assert g.dtype == w.dtype and g.shape == w.shape
        tol = 1e-5 if g.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    rne = torch.where(keep, (branch.float() * scale).to(branch_dtype), 0).to(branch_dtype)
    for g, w in zip(rln.reference_forward(branch, residual, weight, bias, 1e-12, out16, keep=keep, scale=scale),
                    rln.reference_forward(rne, residual, weight, bias, 1e-12, out16)):
        assert torch.equal(g, w)
    got = rln.backward_with_params(grad_y, branch, residual, weight, mean, rstd, keep, scale, raw=True)
    for g, w in zip(got, rln.backward_with_params(grad_y, dropped, residual, weight, mean, rstd, keep, scale)):
        assert torch.equal(g, w)
    for g, w in zip(rln.backward(grad_y, branch, residual, weight, mean, rstd, keep, scale, raw=True),
                    rln.backward(grad_y, dropped, residual, weight, mean, rstd, keep, scale)):
        assert torch.equal(g, w)
    ref = rln.reference_backward_with_params(grad_y, dropped, residual, weight, mean, rstd, keep, scale)
    for i, (g, w) in enumerate(zip(got, ref)):
        sixteen = g.dtype != torch.float32 or (i == 4 and branch_dtype != torch.float32)
        tol = 3e-2 if sixteen else 1e-4
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=f"output {i}")
    for g, w in zip(rln.reference_backward_with_params(grad_y, branch, residual, weight, mean, rstd, keep, scale,
                                                       raw=True),
                    rln.reference_backward_with_params(grad_y, rne, residual, weight, mean, rstd, keep, scale)):
        assert torch.equal(g, w)


@pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
def test_dropout_rate_rows_and_refusals():
    """The drop rate is p (to sampling error); a row's mask does not depend on the call's row count; p = 0 keeps
    everything; bad arguments are refused by name."""
    n, D = (256, 768) if DEVICE == "cuda" else (16, 256)
    branch = torch.ones(n, D, device=DEVICE, dtype=torch.bfloat16)
    residual = torch.zeros(n, D, device=DEVICE)
    weight, bias = torch.ones(D, device=DEVICE), torch.zeros(D, device=DEVICE)
    keep = rln.forward_with_dropout(branch, residual, weight, bias, 1e-5, 0.1, _key(-5), 3)[4]
    rate = 1 - keep.float().mean().item()
    assert abs(rate - 0.1) < 5 * (0.1 * 0.9 / keep.numel()) ** 0.5
    first = rln.forward_with_dropout(branch[:3], residual[:3], weight, bias, 1e-5, 0.1, _key(-5), 3)[4]
    assert torch.equal(first, keep[:3])
    assert rln.forward_with_dropout(branch, residual, weight, bias, 1e-5, 0.0, _key(-5))[4].all()
    assert rln.threshold(0.1) == round(0.1 * 2 ** 32) and rln.threshold(0.0) == 0
    with pytest.raises(ValueError, match="p="):
        rln.forward_with_dropout(branch, residual, weight, bias, 1e-5, 1.0, _key(1))
    with pytest.raises(ValueError, match="key must be"):
        rln.forward_with_dropout(branch, residual, weight, bias, 1e-5, 0.1, 1)
    with pytest.raises(ValueError, match="stream="):
        rln.forward_with_dropout(branch, residual, weight, bias, 1e-5, 0.1, _key(1), -1)
    with pytest.raises(ValueError, match="raw=True"):
        rln.backward(residual, branch, residual, weight, residual[:, 0], residual[:, 0], None, 1.0, raw=True)
