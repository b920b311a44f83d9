"""cat_fast.layers.double_attention: the twice-differentiable fused attention. The kernels (on the CPU under the
Triton interpreter) against the plain composition of the formula in float64: the output, the backward and the double
backward with respect to q, k, v and the output gradient, with padding and all-padding rows, HF's additive masks,
dropout keep masks, TQ ≠ TK, odd head sizes, B = 1, inputs in any layout; gradcheck and gradgradcheck; the errors;
the Hugging Face implementation; on CUDA, fp32 / bf16 against the composition. Exact GS on it:
tests/layers/test_double_layers.py."""
import os

import pytest
import torch

from cat_fast.layers import double_attention as da

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
RUNS = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
needs_kernel = pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Under the interpreter, 16-row tiles: the loops over several tiles on shapes it runs in seconds."""
    if not CUDA:
        from cat_fast.kernels.triton import attention as kernels

        monkeypatch.setattr(kernels, "BLOCK", 16)


def _inputs(B, H, TQ, TK, D, dtype=torch.float64, device=DEVICE, seed=0, layout="hf"):
    """q, k, v as leaves: "hf" the head views of token-major buffers (what HF hands over), "heads" contiguous
    [B, H, T, D], "strided" slices of wider tensors."""
    g = torch.Generator().manual_seed(seed)

    def one(T):
        if layout == "hf":
            t = torch.randn(B, T, H, D, generator=g, dtype=dtype).to(device).transpose(1, 2)
        elif layout == "heads":
            t = torch.randn(B, H, T, D, generator=g, dtype=dtype).to(device)
        else:
            t = torch.randn(B, H, T, D + 3, generator=g, dtype=dtype).to(device)[..., 3:]
        return t.requires_grad_(True)

    return one(TQ), one(TK), one(TK)


def _padding(B, TK, device=DEVICE, empty_row=None):
    lengths = torch.arange(B) % TK + 1
    mask = torch.arange(TK)[None, :] < lengths[:, None]
    if empty_row is not None:
        mask[empty_row] = False
    return mask[:, None, None, :].to(device)


def _both(q, k, v, mask, p, keep):
    """(fused, composition) outputs for the same inputs and keep mask."""
    B, H, TQ, D = q.shape
    bias = da._bias(mask, q, (B, H, TQ, k.shape[2]))
    return (da.attention(q, k, v, mask, p, keep=keep),
            da.reference(q, k, v, bias, keep, D ** -0.5, 1.0 / (1.0 - p)))


def _check_all_orders(got, want, tensors, atol, rtol, seed=3):
    """The outputs, the gradients (create_graph) and the gradients of a random combination of those gradients with
    respect to the inputs and to the output gradient, fused against composition."""
    g = torch.Generator().manual_seed(seed)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    go = torch.randn(got.shape, generator=g, dtype=torch.float64).to(got).requires_grad_(True)
    first = [torch.autograd.grad(out, tensors, go, create_graph=True) for out in (got, want)]
    for a, b in zip(*first):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    cot = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(t) for t in first[0]]
    second = [torch.autograd.grad(sum((x * c).sum() for x, c in zip(grads, cot)), (*tensors, go))
              for grads in first]
    for a, b in zip(*second):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    assert any(float(t.abs().max()) > 0 for t in second[0])


@needs_kernel
@pytest.mark.parametrize("B,H,TQ,TK,D", [(2, 2, 19, 37, 12), (1, 1, 1, 1, 8), (3, 1, 33, 33, 16), (2, 3, 5, 9, 20)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_every_order_matches_the_composition_in_float64(B, H, TQ, TK, D, masked, p):
    q, k, v = _inputs(B, H, TQ, TK, D, seed=B * TQ + TK)
    mask = _padding(B, TK) if masked else None
    keep = None
    if p:
        keep = torch.rand(B, H, TQ, TK, generator=torch.Generator().manual_seed(5)).ge(p).to(DEVICE)
    got, want = _both(q, k, v, mask, p, keep)
    assert got.shape == (B, H, TQ, D) and got.dtype == torch.float64
    _check_all_orders(got, want, (q, k, v), atol=1e-10, rtol=1e-10)


@needs_kernel
@pytest.mark.parametrize("layout", ["heads", "strided"])
def test_any_input_layout(layout):
    q, k, v = _inputs(2, 2, 11, 11, 8, layout=layout)
    got, want = _both(q, k, v, _padding(2, 11), 0.0, None)
    _check_all_orders(got, want, (q, k, v), atol=1e-10, rtol=1e-10)


@needs_kernel
def test_all_padding_rows_and_hf_additive_masks():
    q, k, v = _inputs(3, 2, 6, 6, 8)
    empty = _padding(3, 6, empty_row=1)  # every key of sequence 1 masked: its output and gradients are 0
    got, want = _both(q, k, v, empty, 0.0, None)
    assert got[1].abs().max() == 0
    _check_all_orders(got, want, (q, k, v), atol=1e-10, rtol=1e-10)
    # HF's eager masks: finfo.min added to masked scores (a fully masked row is uniform there, as eager's softmax)
    additive = torch.zeros(3, 1, 6, 6, dtype=torch.float64, device=DEVICE).masked_fill(
        ~empty.expand(3, 1, 6, 6), torch.finfo(torch.float64).min)
    got, want = _both(q, k, v, additive, 0.0, None)
    _check_all_orders(got, want, (q, k, v), atol=1e-10, rtol=1e-10)


def _spans_mask(B, TQ, TK):
    """A bool mask [B, 1, TQ, TK] whose sequences attend: keys 20.. (left padding), all keys, keys 5..11 and key 30
    from one query row only (a span with a hole across tiles), and no key."""
    mask = torch.zeros(B, 1, TQ, TK, dtype=torch.bool)
    mask[0, ..., 20:] = True
    mask[1] = True
    mask[2, ..., 5:12] = True
    mask[2, :, TQ - 1, 30] = True
    return mask


def test_key_span_is_the_attended_keys_of_each_sequence():
    from cat_fast.kernels.triton import attention as kernels

    q = torch.zeros(4, 2, 3, 8, dtype=torch.float64)
    bias = da._bias(_spans_mask(4, 3, 37), q, (4, 2, 3, 37))
    assert kernels.key_span(bias).tolist() == [[20, 37], [0, 37], [5, 31], [37, 0]]
    shared = da._bias(torch.arange(37) < 9, q, (4, 2, 3, 37))  # one mask for every sequence: one span
    assert kernels.key_span(shared).tolist() == [[0, 9]]
    assert kernels.key_span(None) is None


@needs_kernel
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_keys_outside_each_sequences_span_are_skipped_exactly(p):
    """The key tiles the kernels skip (left and right of each sequence's attended keys, 16-key tiles) change
    nothing: every order equals the composition, and a sequence that attends no key gets zeros."""
    B, H, TQ, TK = 4, 2, 7, 37
    q, k, v = _inputs(B, H, TQ, TK, 12, seed=11)
    keep = None
    if p:
        keep = torch.rand(B, H, TQ, TK, generator=torch.Generator().manual_seed(6)).ge(p).to(DEVICE)
    got, want = _both(q, k, v, _spans_mask(B, TQ, TK).to(DEVICE), p, keep)
    assert got[3].abs().max() == 0
    _check_all_orders(got, want, (q, k, v), atol=1e-10, rtol=1e-10)


@needs_kernel
def test_each_kernel_takes_its_own_tiles(monkeypatch):
    """`TILES` (16-bit inputs; here the same code path for float64, or float32 on CUDA) gives the row passes and the
    column passes tiles of other shapes than each other's and the forward's: every order still equals the
    composition, over several tiles of rows and of keys and across each sequence's span."""
    from cat_fast.kernels.triton import attention as kernels

    dtype = torch.float32 if CUDA else torch.float64
    monkeypatch.setattr(kernels, "_SIXTEEN", (dtype,))
    monkeypatch.setattr(kernels, "TILES", {"dq": (32, 16, 4, None), "dkdv": (16, 32, 4, 2),
                                           "dd_rows": (32, 16, 2, None), "dd_cols": (16, 32, 4, None)})
    B, H, TQ, TK = 4, 2, 45, 37
    q, k, v = (t.detach().to(dtype).requires_grad_(True) for t in _inputs(B, H, TQ, TK, 12, seed=12))
    got, want = _both(q, k, v, _spans_mask(B, TQ, TK).to(DEVICE), 0.0, None)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    _check_all_orders(got.double(), want.double(), (q, k, v), atol=tol, rtol=tol)


@needs_kernel
def test_gradcheck_and_gradgradcheck():
    q, k, v = _inputs(1, 1, 2, 3, 3)  # few entries: the interpreter runs the kernels once per perturbation
    mask = torch.tensor([True, False, True], device=DEVICE)
    keep = torch.tensor([[1, 1, 1], [0, 1, 1]], dtype=torch.uint8, device=DEVICE).expand(1, 1, 2, 3)

    def fn(q, k, v):
        return da.attention(q, k, v, mask, 0.25, keep=keep)

    # under the interpreter: random projections of the Jacobian, not all of it (speed)
    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=not CUDA)
    assert torch.autograd.gradgradcheck(fn, (q, k, v), fast_mode=not CUDA)


@needs_kernel
def test_one_cotangent_at_a_time():
    # each of dq, dk, dv differentiated alone (the kernels skip an absent cotangent)
    q, k, v = _inputs(2, 2, 7, 7, 8)
    go = torch.randn(2, 2, 7, 8, dtype=torch.float64, device=DEVICE)
    for which in range(3):
        grads = [torch.autograd.grad(out, (q, k, v), go, create_graph=True)[which]
                 for out in _both(q, k, v, _padding(2, 7), 0.0, None)]
        w = torch.randn_like(grads[0])
        a, b = (torch.autograd.grad((g * w).sum(), (q, k, v), allow_unused=True) for g in grads)
        for x, y in zip(a, b):
            torch.testing.assert_close(x if x is not None else torch.zeros_like(y),
                                       y if y is not None else torch.zeros_like(x), atol=1e-10, rtol=1e-10)


@needs_kernel
def test_dropout_draws_a_keep_mask_with_the_given_rate():
    torch.manual_seed(0)
    q, k, v = _inputs(2, 2, 16, 16, 8)
    ones = torch.ones_like(v)
    out = da.attention(q, k, ones, None, 0.5).detach()  # each output entry: (kept probability mass) · 2
    assert 0.7 < float(out.mean()) < 1.3 and float(out.std()) > 0.1
    assert float(da.attention(q, k, ones, None, 0.0).sub(1).abs().max()) < 1e-12


def test_bad_inputs_are_named():
    q, k, v = _inputs(2, 2, 4, 4, 8, device="cpu")
    with pytest.raises(ValueError, match="q: expected a \\[B, H, T, D\\]"):
        da.attention(q[0], k, v)
    with pytest.raises(ValueError, match="k, v \\[B, H, TK, D\\]"):
        da.attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match="one floating dtype"):
        da.attention(q, k.float(), v)
    with pytest.raises(ValueError, match="dropout_p"):
        da.attention(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match="mask: expected a shape broadcastable"):
        da.attention(q, k, v, torch.ones(3, 1, 1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="without a gradient"):
        da.attention(q, k, v, torch.zeros(1, 1, 1, 4, dtype=torch.float64, requires_grad=True))
    with pytest.raises(ValueError, match="keep: expected shape"):
        da.attention(q, k, v, dropout_p=0.1, keep=torch.ones(2, 2, 4, dtype=torch.uint8))


def test_hf_implementation_is_installed_for_the_block_and_restored():
    from tests.conftest import tiny_model

    model = tiny_model("bert", attn="sdpa")
    with da.installed(model):
        assert model.config._attn_implementation == da.NAME
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"), da.installed(model):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


@needs_kernel
def test_hf_causal_modules_get_the_causal_mask():
    q, k, v = _inputs(1, 2, 5, 5, 8)

    class Causal(torch.nn.Module):
        is_causal = True

    out, none = da.hf_attention(Causal(), q, k, v, None, dropout=0.0, scaling=0.5)
    tril = torch.ones(5, 5, dtype=torch.bool, device=DEVICE).tril()
    want = da.reference(q, k, v, da._bias(tril, q, (1, 2, 5, 5)), None, 0.5).transpose(1, 2)
    assert none is None and out.shape == (1, 5, 2, 8)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)


@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_cuda_16_and_32_bit_against_the_composition(dtype, tol, p):
    B, H, T, D = 4, 12, 200, 64
    q, k, v = (t.detach().to(dtype).requires_grad_(True) for t in _inputs(B, H, T, T, D, dtype=torch.float32))
    mask = _padding(B, T) | (torch.arange(T, device=DEVICE) < 150)
    keep = torch.rand(B, H, T, T, device=DEVICE).ge(p) if p else None
    got, _ = _both(q, k, v, mask, p, keep)
    # the composition in float64 from the same (rounded) inputs
    ref = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    want = da.reference(*ref, da._bias(mask, ref[0], (B, H, T, T)), keep, D ** -0.5, 1.0 / (1.0 - p))
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    go = torch.randn(got.shape, device=DEVICE, generator=g)
    first = torch.autograd.grad(got, (q, k, v), go.to(dtype), create_graph=True)
    first_ref = torch.autograd.grad(want, ref, go.double(), create_graph=True)
    cot = [torch.randn(t.shape, device=DEVICE, generator=g) for t in first]
    second = torch.autograd.grad(sum((x.float() * c).sum() for x, c in zip(first, cot)), (q, k, v))
    second_ref = torch.autograd.grad(sum((x * c.double()).sum() for x, c in zip(first_ref, cot)), ref)
    for a, b in zip((*first, *second), (*first_ref, *second_ref)):
        scale = float(b.abs().max())
        torch.testing.assert_close(a.double() / scale, b / scale, atol=tol, rtol=tol)
