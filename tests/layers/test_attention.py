"""cat_fast.layers.attention: one query per sequence. The fused kernel (on the CPU under the Triton interpreter)
against a plain composition of its formula, in float64 to rounding, with gradients (gradcheck), masks, dropout,
odd shapes, B = 1, all-padding rows and non-contiguous inputs; the dispatcher against SDPA; on CUDA, fp32 / bf16
against SDPA and the composition, and the dropout draws."""
import os

import pytest
import torch
import torch.nn.functional as F

from cat_fast.layers import attention

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
RUNS = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
needs_kernel = pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")


def _reference(q, k, v, bias, heads, keep, scale, p):
    """softmax(scale q.k + bias) (0 where every score is -inf) * keep / (1 - p) @ v, per head, as [B, 1, H*D]."""
    B, T, HD = k.shape
    D = HD // heads
    qh = q.view(B, 1, heads, D).transpose(1, 2)
    kh, vh = (t.reshape(B, T, heads, D).transpose(1, 2) for t in (k, v))
    s = (qh @ kh.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.expand(B, heads, T).unsqueeze(2)
    empty = torch.isneginf(s).all(-1, keepdim=True)  # no key: p = 0 and no gradient (SDPA's safe softmax)
    probs = torch.where(empty, 0.0, torch.softmax(torch.where(empty, 0.0, s), -1))
    if keep is not None:
        probs = probs * keep.view(B, heads, 1, T).to(probs.dtype) / (1.0 - p)
    return (probs @ vh).transpose(1, 2).reshape(B, 1, HD)


def _inputs(B, T, heads, D, dtype=torch.float64, device=DEVICE, seed=0, packed=False, strided=False):
    g = torch.Generator().manual_seed(seed)
    HD = heads * D
    q = torch.randn(B, 1, HD, generator=g, dtype=dtype)
    kv = torch.randn(B, T, 2 * HD + (5 if strided else 0), generator=g, dtype=dtype)
    q, kv = q.to(device), kv.to(device)
    if strided:  # q a column slice, k and v slices of a wider tensor: no tensor contiguous
        q = torch.randn(B, 1, HD + 3, generator=g, dtype=dtype).to(device)[..., 3:]
        kv = kv[..., 5:]
    if packed:
        return q, kv.contiguous() if not strided else kv
    return q, kv[..., :HD], kv[..., HD:]


def _grads(out, tensors, seed=1):
    # drawn in float64 and rounded: the same gradient for a 16-bit / fp32 output and its float64 reference
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g = g.to(device=out.device, dtype=out.dtype)
    return torch.autograd.grad(out, tensors, g)


def _padding_bias(B, T, dtype, all_padding_row=None, device=DEVICE):
    lengths = torch.arange(B) % max(T, 1) + 1
    bias = torch.zeros(B, 1, T, dtype=dtype)
    for i, n in enumerate(lengths.tolist()):
        bias[i, :, n:] = torch.finfo(dtype).min
    if all_padding_row is not None:
        bias[all_padding_row] = torch.finfo(dtype).min
    return bias.to(device)


@needs_kernel
@pytest.mark.parametrize("B,T,heads,D", [(3, 37, 2, 24), (1, 1, 1, 8), (2, 130, 3, 16), (4, 64, 2, 64)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_matches_the_composition_in_float64(B, T, heads, D, masked, p):
    q, k, v = (t.requires_grad_(True) for t in _inputs(B, T, heads, D, seed=B * T))
    bias = _padding_bias(B, T, torch.float64) if masked else None
    keep = None
    if p:
        keep = torch.rand(B, heads, T, generator=torch.Generator().manual_seed(5)).ge(p).to(DEVICE)
    scale = D ** -0.5
    got = attention.fused_first_row(q, (k, v), bias, heads, keep, scale, p)
    want = _reference(q, k, v, bias, heads, keep, scale, p)
    assert got.shape == (B, 1, heads * D) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(_grads(got, (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@needs_kernel
@pytest.mark.parametrize("packed", [False, True])
def test_gradcheck_with_mask_and_dropout(packed):
    B, T, heads, D = 2, 5, 2, 3
    inputs = [t.requires_grad_(True) for t in _inputs(B, T, heads, D, packed=packed, seed=7)]
    bias = _padding_bias(B, T, torch.float64)
    keep = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 0, 1, 0]], dtype=torch.uint8).repeat(B, 1, 1).to(DEVICE)
    if packed:
        fn = lambda q, kv: attention.fused_first_row(q, kv, bias, heads, keep, 0.7, 0.25)  # noqa: E731
    else:
        fn = lambda q, k, v: attention.fused_first_row(q, (k, v), bias, heads, keep, 0.7, 0.25)  # noqa: E731
    # under the interpreter: random projections of the Jacobian, not all of it (speed)
    assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-9, fast_mode=not CUDA)


@needs_kernel
def test_packed_keys_values_give_one_gradient_and_the_pair_s_values():
    q, kv = (t.requires_grad_(True) for t in _inputs(3, 19, 2, 8, packed=True, seed=3))
    bias = _padding_bias(3, 19, torch.float64)
    out = attention.fused_first_row(q, kv, bias, 2, None, 0.5)
    dq, dkv = _grads(out, (q, kv))
    want = _reference(q, kv[..., :16], kv[..., 16:], bias, 2, None, 0.5, 0.0)
    wq, wkv = _grads(want, (q, kv))
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dq, wq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dkv, wkv, rtol=1e-12, atol=1e-12)
    assert dkv.shape == kv.shape and dkv.is_contiguous()


@needs_kernel
@pytest.mark.parametrize("mask_kind", ["float", "bool"])
def test_all_padding_rows_and_non_contiguous_inputs(mask_kind):
    B, T, heads, D = 3, 21, 2, 8
    q, k, v = (t.requires_grad_(True) for t in _inputs(B, T, heads, D, strided=True, seed=11))
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    if mask_kind == "float":  # every key padded in row 1: HF's finite minimum, a uniform softmax
        bias = _padding_bias(B, T, torch.float64, all_padding_row=1)
        want_bias = bias
    else:  # a bool mask with no key in row 1: SDPA's math path gives 0 there, as the kernel does
        allowed = torch.ones(B, 1, 1, T, dtype=torch.bool, device=DEVICE)
        allowed[0, ..., 15:] = False
        allowed[1] = False
        bias = attention.score_bias(allowed, B, heads, T, q.device)
        want_bias = bias
    got = attention.fused_first_row(q, (k, v), bias, heads, None, 0.3)
    want = _reference(q, k, v, want_bias, heads, None, 0.3, 0.0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grads = _grads(got, (q, k, v))
    for a, b in zip(grads, _grads(want, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    if mask_kind == "bool":
        assert got[1].eq(0).all() and all(t[1].eq(0).all() for t in grads)
    else:
        assert got[1].isfinite().all() and not got[1].eq(0).all()


def _packed_keys(lengths, T, heads, D, dtype=torch.float64, device=DEVICE, extra=0, extended=0, holes=False, seed=0):
    """Packed keys as `layers.packing.Plan` lays them out: ``(q, kv [N, 2*H*D], rows, real, idx)``, the B sequences'
    keys (a prefix of `lengths`, or with `holes` every third position after the first left out), `extended` more
    packed non-key rows after each sequence's keys (CMIX's lent rows: the gathered key order), `extra` rows of a
    static count after them."""
    from cat_fast.layers import packing

    B = len(lengths)
    pos = torch.arange(T)
    real = pos < torch.tensor(lengths)[:, None]
    if holes:
        real &= (pos % 3 != 2)
    picked = real | (pos < torch.tensor(lengths)[:, None] + extended) if extended else real
    idx = picked.reshape(-1).nonzero().squeeze(1)
    static = None
    if extra:
        static = idx.numel() + extra
        idx = torch.cat([idx, (~picked).reshape(-1).nonzero().squeeze(1)[:extra]])
    plan = packing.Plan(idx.to(device), B, T, real.to(device), static, picked.to(device) if extended else None)
    rows, starts = plan.first_row_keys()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, heads * D, generator=g, dtype=dtype).to(device)
    kv = torch.randn(idx.numel(), 2 * heads * D, generator=g, dtype=dtype).to(device)
    assert torch.equal(idx[starts.cpu()], torch.arange(B) * T)  # each sequence's row 0 where it is packed
    return q, kv, rows, real.to(device), idx.to(device)


def _packed_reference(q, kv, real, idx, heads, keep, scale, p):
    """The composition over the keys and values put back in the padded layout (zeros elsewhere), padding masked."""
    B, T = real.shape
    HD = q.shape[-1]
    full = kv.new_zeros(B * T, 2 * HD).index_copy(0, idx, kv).view(B, T, 2 * HD)
    bias = torch.zeros(B, 1, T, dtype=kv.dtype, device=kv.device).masked_fill(~real[:, None], float("-inf"))
    return _reference(q, full[..., :HD], full[..., HD:], bias, heads, keep, scale, p)


@needs_kernel
@pytest.mark.parametrize("lengths,T", [([7, 3, 11], 11), ([1], 4), ([5, 1, 1, 9], 9), ([40, 130], 130)])
@pytest.mark.parametrize("layout", ["keys", "holes", "extended", "static"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_packed_keys_match_the_composition_in_float64(lengths, T, layout, p):
    """Keys read from packed rows (`first_row_packed`'s kernel): the output and the gradients of the query and of
    every packed row (zero on rows that are no key) equal the composition over the padded layout; the keep mask is
    read at the keys' padded positions."""
    heads, D = 2, 8
    q, kv, rows, real, idx = _packed_keys(lengths, T, heads, D, holes=layout == "holes",
                                          extended=2 if layout == "extended" else 0,
                                          extra=5 if layout == "static" else 0, seed=len(lengths) * T)
    assert (rows[1] is not None) == (layout == "extended")
    q.requires_grad_(True), kv.requires_grad_(True)
    keep = None
    if p:
        keep = torch.rand(len(lengths), heads, T, generator=torch.Generator().manual_seed(5)).ge(p).to(DEVICE)
    got = attention.fused_first_row_packed(q, kv, rows, heads, keep, D ** -0.5, p)
    want = _packed_reference(q, kv, real, idx, heads, keep, D ** -0.5, p)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (dq, dkv), (wq, wkv) = _grads(got, (q, kv)), _grads(want, (q, kv))
    torch.testing.assert_close(dq, wq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dkv, wkv, rtol=1e-12, atol=1e-12)
    keys = real.reshape(-1)[idx]
    assert dkv[~keys].eq(0).all() and dkv[keys].ne(0).any()


@needs_kernel
def test_packed_keys_gradcheck_with_dropout():
    heads, D = 2, 3
    q, kv, rows, _, _ = _packed_keys([4, 2, 5], 5, heads, D, extended=1, extra=2, seed=3)
    keep = torch.rand(3, heads, 5, generator=torch.Generator().manual_seed(2)).ge(0.3).to(DEVICE)
    fn = lambda q, kv: attention.fused_first_row_packed(q, kv, rows, heads, keep, 0.7, 0.3)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q.requires_grad_(True), kv.requires_grad_(True)), eps=1e-6, atol=1e-9,
                                    fast_mode=not CUDA)  # under the interpreter: random projections (speed)


def test_packed_keys_off_the_kernel_put_them_back_and_run_first_row():
    """The dispatcher off the kernel (the CPU): the keys and values put back in the padded layout and `first_row`
    over it, real keys only; bad shapes are refused naming the function and what it expects."""
    q, kv, rows, real, idx = _packed_keys([6, 2, 4], 6, 3, 4, device="cpu", extended=1, seed=4)
    q.requires_grad_(True), kv.requires_grad_(True)
    got = attention.first_row_packed(q, kv, rows, real, 3, 0.0, 0.5)
    want = _packed_reference(q, kv, real, idx, 3, None, 0.5, 0.0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(_grads(got, (q, kv)), _grads(want, (q, kv))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"first_row_packed: expected q \[B, 1, H\*D\] \(B >= 1\), keys_values "
                                         r"\[N, 2\*H\*D\]"):
        attention.first_row_packed(q, kv[:, :-1], rows, real, 3, 0.0, 0.5)
    with pytest.raises(ValueError, match=r"real \(3, 5\)"):
        attention.first_row_packed(q, kv, rows, real[:, :5], 3, 0.0, 0.5)
    with pytest.raises(ValueError, match="expected one floating dtype"):
        attention.first_row_packed(q.float(), kv, rows, real, 3, 0.0, 0.5)


def test_the_dispatcher_is_sdpa_where_the_kernel_does_not_run():
    # CPU (or a mask the kernel does not take): the SDPA call itself, bit for bit
    q, k, v = _inputs(2, 9, 3, 4, device="cpu")
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., 6:] = False
    got = attention.first_row(q, (k, v), mask, 3, 0.0, 0.5)
    want = F.scaled_dot_product_attention(q.view(2, 1, 3, 4).transpose(1, 2), k.reshape(2, 9, 3, 4).transpose(1, 2),
                                          v.reshape(2, 9, 3, 4).transpose(1, 2), attn_mask=mask, scale=0.5)
    assert torch.equal(got, want.transpose(1, 2).reshape(2, 1, 12))
    assert attention.score_bias(torch.zeros(2, 1, 3, 9), 2, 3, 9, q.device) is False  # several query rows
    assert attention.score_bias(torch.zeros(2, 1, 1, 9, requires_grad=True), 2, 3, 9, q.device) is False


def test_bad_shapes_are_refused_with_the_argument_named():
    q, k, v = _inputs(2, 9, 3, 4, device="cpu")
    with pytest.raises(ValueError, match=r"expected q \[B, 1, H\*D\] and k, v \[B, T, H\*D\] with H = heads = 5"):
        attention.fused_first_row(q, (k, v), None, 5, None, 1.0)
    with pytest.raises(ValueError, match=r"keys_values: expected \[B, T, 2\*H\*D\] with H\*D = 12"):
        attention.fused_first_row(q, k, None, 3, None, 1.0)
    with pytest.raises(ValueError, match=r"k: expected a 3-D tensor with unit column stride"):
        attention.fused_first_row(q, (k.transpose(1, 2), v), None, 3, None, 1.0)
    with pytest.raises(ValueError, match=r"k, v: expected at least one sequence and one key, got shape \(2, 0, 12\)"):
        attention.fused_first_row(q, (k[:, :0], v[:, :0]), None, 3, None, 1.0)
    with pytest.raises(ValueError, match=r"q, k, v: expected one floating dtype"):
        attention.fused_first_row(q.float(), (k, v), None, 3, None, 1.0)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("B,T", [(1, 1), (8, 128), (5, 77), (64, 256)])
def test_cuda_matches_sdpa_and_the_composition(dtype, tol, B, T):
    heads, D = 12, 64
    q, k, v = (t.requires_grad_(True) for t in _inputs(B, T, heads, D, dtype=dtype, seed=T))
    mask = _padding_bias(B, T, dtype).unsqueeze(2)  # [B, 1, 1, T], as the first-token layer passes it
    got = attention.first_row(q, (k, v), mask, heads, 0.0, D ** -0.5)
    attention.FUSED = False
    try:
        sdpa = attention.first_row(q, (k, v), mask, heads, 0.0, D ** -0.5)
    finally:
        attention.FUSED = True
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    exact = _reference(q64, k64, v64, mask[:, :, 0].double(), heads, None, D ** -0.5, 0.0)
    torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol)
    torch.testing.assert_close(sdpa.double(), exact, rtol=tol, atol=tol)
    for a, b in zip(_grads(got, (q, k, v)), _grads(exact, (q64, k64, v64))):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_dropout_draws_one_bernoulli_keep_mask_from_torch_s_generator():
    B, T, heads, D, p = 16, 100, 12, 64, 0.1
    q, k, v = (t.requires_grad_(True) for t in _inputs(B, T, heads, D, dtype=torch.float32, seed=2))
    mask = _padding_bias(B, T, torch.float32).unsqueeze(2)
    torch.manual_seed(123)
    got = attention.first_row(q, (k, v), mask, heads, p, 0.125)
    torch.manual_seed(123)
    keep = torch.empty(B, heads, T, device="cuda", dtype=torch.uint8).bernoulli_(1.0 - p)
    assert 0.85 < keep.float().mean().item() < 0.95
    want = _reference(q, k, v, mask[:, :, 0], heads, keep, 0.125, p)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    for a, b in zip(_grads(got, (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graph_replays_draw_new_masks():
    B, T, heads, D = 4, 50, 2, 32
    q, k, v = _inputs(B, T, heads, D, dtype=torch.float32, seed=4)
    static = [t.clone() for t in (q, k, v)]
    attention.first_row(static[0], tuple(static[1:]), None, heads, 0.5, 1.0)  # warm-up (Triton compile)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        attention.first_row(static[0], tuple(static[1:]), None, heads, 0.5, 1.0)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        out = attention.first_row(static[0], tuple(static[1:]), None, heads, 0.5, 1.0)
    graph.replay()
    first = out.clone()
    graph.replay()
    assert out.isfinite().all() and not torch.equal(first, out)  # other keep masks each replay
