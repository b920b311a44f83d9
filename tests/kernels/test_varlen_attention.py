"""cat_fast.kernels.triton.varlen_attention against a plain composition of its formula, per sequence, with the
kernels' own keep mask (`keep_mask`); float64 gradcheck; the mask's rate and independence of the tiles; PyTorch's
flash attention at p = 0 on a GPU. On the CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1)."""
import os

import pytest
import torch

pytest.importorskip("triton")
from cat_fast.kernels.triton import varlen_attention as va  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
RUNS = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
needs_kernel = pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")


def _offsets(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def _reference(q, k, v, cu_q, cu_k, keep, scale, p):
    """Per sequence: softmax(scale q kᵀ) ∘ keep / (1 − p') @ v, [Nq, H, D]; 0 for rows of no sequence or no keys."""
    out = torch.zeros_like(q)
    for b in range(cu_q.shape[0] - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0 or k1 == k0:
            continue
        qs, ks, vs = q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1)
        P = torch.softmax(qs @ ks.transpose(1, 2) * scale, -1)
        Z = keep[b, :, :q1 - q0, :k1 - k0].to(q.dtype) / (1 - va.drop_rate(p))
        out = out.index_put((torch.arange(q0, q1, device=q.device),), ((P * Z) @ vs).transpose(0, 1))
    return out


def _inputs(nq, nk, H, D, dtype, seed, joined=True):
    g = torch.Generator().manual_seed(seed)
    if joined:  # views of one [N, 3·H·D] projection, as the layers hand them over (row stride 3·H·D)
        n = max(nq, nk)
        qkv = torch.randn(n, 3 * H * D, generator=g, dtype=torch.float64).to(DEVICE, dtype)
        return [qkv[:m, i * H * D:(i + 1) * H * D].view(m, H, D) for i, m in ((0, nq), (1, nk), (2, nk))]
    return [torch.randn(m, H, D, generator=g, dtype=torch.float64).to(DEVICE, dtype) for m in (nq, nk, nk)]


CASES = [  # (query lengths, key lengths): keys = queries; a sequence of one row; an empty one; more keys than
    # queries (keys lent by partners); a sequence with queries and no keys
    ([5, 1, 17, 9], None),
    ([1], None),
    ([3, 0, 20], None),
    ([4, 7], [9, 12]),
    ([3, 2], [0, 5]),
]


@needs_kernel
@pytest.mark.parametrize("lengths,key_lengths", CASES)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_float64_forward_and_backward_equal_the_composition(lengths, key_lengths, p):
    H, D = 2, 16
    key_lengths = key_lengths or lengths
    cu_q, cu_k = _offsets(lengths), _offsets(key_lengths)
    nq, nk = sum(lengths), sum(key_lengths)
    q, k, v = _inputs(nq, nk, H, D, torch.float64, len(lengths))
    key = va.draw_key(DEVICE, torch.Generator(DEVICE).manual_seed(3))
    mq, mk, scale = max(lengths), max(key_lengths), 0.3
    keep = va.keep_mask(key, cu_q, cu_k, H, mq, mk, p)
    out, lse, bits = va.forward(q, k, v, cu_q, cu_k, mq, mk, scale, p, key)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*leaves, cu_q, cu_k, keep, scale, p)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)
    g = torch.Generator().manual_seed(9)
    do = torch.randn(out.shape, generator=g, dtype=torch.float64).to(DEVICE)
    ref.backward(do)
    grads = va.backward(do, q, k, v, out, lse, cu_q, cu_k, mq, mk, scale, p, bits)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-11, atol=1e-11)
    if p and H * sum(a * b for a, b in zip(lengths, key_lengths)) >= 100:  # some dropped, some kept
        assert 0 < keep.sum() < H * sum(a * b for a, b in zip(lengths, key_lengths))


@needs_kernel
def test_gradcheck_float64_with_dropout():
    H, D, lengths = 1, 16, [3, 5]
    cu = _offsets(lengths)
    key = va.draw_key(DEVICE, torch.Generator(DEVICE).manual_seed(1))
    args = (cu, cu, 5, 5, 0.25, 0.2)

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse, bits = va.forward(q, k, v, *args, key)
            ctx.save_for_backward(q, k, v, out, lse, bits)
            return out

        @staticmethod
        def backward(ctx, do):
            q, k, v, out, lse, bits = ctx.saved_tensors
            return va.backward(do.contiguous(), q, k, v, out, lse, *args, bits)

    q, k, v = (t.detach().requires_grad_() for t in _inputs(8, 8, H, D, torch.float64, 4, joined=False))
    # under the interpreter: random projections of the Jacobian, not all of it (speed)
    assert torch.autograd.gradcheck(F.apply, (q, k, v), eps=1e-6, atol=1e-7, fast_mode=not CUDA)


@needs_kernel
def test_outputs_into_views_of_one_gradient_and_rows_of_no_sequence():
    # dq, dk, dv written into the column blocks of one [N, 3·H·D] buffer; the last two rows lie in no sequence:
    # their outputs and gradients are 0 (covered=False), and covered=True leaves them alone
    H, D, lengths = 2, 16, [4, 6]
    cu = _offsets(lengths)
    q, k, v = _inputs(12, 12, H, D, torch.float64, 5)
    out, lse, _ = va.forward(q, k, v, cu, cu, 6, 6, 0.25)
    assert out[10:].eq(0).all()
    ref_out, _, _ = va.forward(q[:10], k[:10], v[:10], cu, cu, 6, 6, 0.25, covered=True)
    torch.testing.assert_close(out[:10], ref_out, rtol=0, atol=0)
    do = torch.randn_like(out)
    g = torch.full((12, 3 * H * D), float("nan"), dtype=torch.float64, device=DEVICE)
    views = [g[:, i * H * D:(i + 1) * H * D].view(12, H, D) for i in range(3)]
    va.backward(do, q, k, v, out, lse, cu, cu, 6, 6, 0.25, dq=views[0], dk=views[1], dv=views[2])
    assert g[10:].eq(0).all() and g[:10].isfinite().all()
    alone = va.backward(do[:10], q[:10], k[:10], v[:10], out[:10], lse[:, :10].contiguous(), cu, cu, 6, 6, 0.25)
    for view, got in zip(views, alone):
        torch.testing.assert_close(view[:10], got, rtol=0, atol=0)


@needs_kernel
def test_the_mask_does_not_depend_on_the_tiles_and_keeps_its_rate(monkeypatch):
    H, D, lengths, p = 2, 16, [37, 50, 3], 0.2
    cu = _offsets(lengths)
    q, k, v = _inputs(90, 90, H, D, torch.float32, 6)
    key = va.draw_key(DEVICE, torch.Generator(DEVICE).manual_seed(2))
    outs = []
    for tiles in ({"forward": (32, 64, 4, 1)}, {"forward": (16, 32, 4, 1)}):
        monkeypatch.setitem(va.TILES, "forward", tiles["forward"])
        outs.append(va.forward(q, k, v, cu, cu, 50, 50, 0.25, p, key)[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    keep = va.keep_mask(key, cu, cu, H, 50, 50, p)
    inside = torch.zeros_like(keep)
    for b, n in enumerate(lengths):
        inside[b, :, :n, :n] = True
    assert not keep[~inside].any()
    rate = 1 - keep[inside].float().mean().item()
    n = inside.sum().item()
    assert abs(rate - va.drop_rate(p)) < 4 * (p * (1 - p) / n) ** 0.5  # 4 standard deviations
    other = va.keep_mask(va.draw_key(DEVICE, torch.Generator(DEVICE).manual_seed(5)), cu, cu, H, 50, 50, p)
    agree = (other[inside] == keep[inside]).float().mean().item()
    assert abs(agree - (1 - 2 * p * (1 - p))) < 0.05  # another key: another mask, independent


def test_drop_rate_and_refusals():
    assert va.drop_rate(0.1) == 26 / 256 and va.drop_rate(0.0) == 0.0 and va.drop_rate(0.001) == 0.0
    q = torch.zeros(4, 2, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="head width 24"):
        va.forward(torch.zeros(4, 2, 24), torch.zeros(4, 2, 24), torch.zeros(4, 2, 24), cu, cu, 4, 4, 1.0)
    with pytest.raises(ValueError, match="dropout key"):
        va.forward(q, q, q, cu, cu, 4, 4, 1.0, 0.1)
    with pytest.raises(ValueError, match="int32"):
        va.forward(q, q, q, cu.long(), cu.long(), 4, 4, 1.0)
    with pytest.raises(ValueError, match="unit stride"):
        va.forward(q.transpose(0, 2), q, q, cu, cu, 4, 4, 1.0)
    with pytest.raises(ValueError, match="p=1.0"):
        va.forward(q, q, q, cu, cu, 4, 4, 1.0, 1.0)
    with pytest.raises(ValueError, match="p=0.001"):  # a rate that rounds to 0: refused, not silently undropped
        va.forward(q, q, q, cu, cu, 4, 4, 1.0, 0.001)
    with pytest.raises(ValueError, match="dropout bits"):
        va.backward(q, q, q, q, q, torch.zeros(2, 4), cu, cu, 4, 4, 1.0, 0.1)
    # offsets within a sequence are 32-bit: a longest sequence whose rows would overflow them is refused
    with pytest.raises(ValueError, match="max_q=67108864 rows of stride 32 exceed"):
        va.forward(q, q, q, cu, cu, 2 ** 31 // 32, 4, 1.0)
    with pytest.raises(ValueError, match="max_k=16777216 rows of stride 128 exceed"):  # a gradient's stride counts
        va.backward(q, q, q, q, q, torch.zeros(2, 4), cu, cu, 4, 2 ** 24, 1.0,
                    dk=torch.zeros(4, 128)[:, :32].view(4, 2, 16))


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_16_bit_equals_flash_attention_at_p0_and_the_composition_with_dropout(dtype):
    H, D = 12, 64
    lengths = [130, 1, 256, 77, 200, 3]
    cu = _offsets(lengths)
    n, T = sum(lengths), max(lengths)
    q, k, v = _inputs(n, n, H, D, dtype, 7)
    scale = D ** -0.5
    do = torch.randn(n, H, D, device=DEVICE, dtype=dtype)
    ref = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, T, T, 0.0, False, False, scale=scale)
    out, lse, _ = va.forward(q, k, v, cu, cu, T, T, scale, covered=True)
    torch.testing.assert_close(out, ref[0], rtol=2e-2, atol=2e-2)
    grads = va.backward(do, q, k, v, out, lse, cu, cu, T, T, scale, covered=True)
    ref_grads = torch.ops.aten._flash_attention_backward(do, q, k, v, ref[0], ref[1], cu, cu, T, T, 0.0, False,
                                                         ref[2], ref[3], scale=scale)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    p = 0.1
    key = va.draw_key(DEVICE)
    keep = va.keep_mask(key, cu, cu, H, T, T, p)
    out, lse, bits = va.forward(q, k, v, cu, cu, T, T, scale, p, key, covered=True)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = _reference(*leaves, cu, cu, keep, scale, p)
    torch.testing.assert_close(out.float(), want.detach(), rtol=2e-2, atol=2e-2)
    want.backward(do.float())
    grads = va.backward(do, q, k, v, out, lse, cu, cu, T, T, scale, p, bits, covered=True)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got.float(), leaf.grad, rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_a_captured_call_redraws_its_key_at_each_replay():
    H, D, lengths = 2, 64, [40, 17]
    cu = _offsets(lengths)
    q, k, v = _inputs(57, 57, H, D, torch.bfloat16, 8)
    static = {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        key = va.draw_key(DEVICE)
        va.forward(q, k, v, cu, cu, 40, 40, 0.125, 0.5, key)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static["key"] = va.draw_key(DEVICE)
        static["out"] = va.forward(q, k, v, cu, cu, 40, 40, 0.125, 0.5, static["key"])[0]
    outs, keys = [], []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        outs.append(static["out"].clone())
        keys.append(static["key"].clone())
    assert not torch.equal(keys[0], keys[1]) and not torch.equal(outs[0], outs[1])
    again = va.forward(q, k, v, cu, cu, 40, 40, 0.125, 0.5, keys[1])[0]
    assert torch.equal(again, outs[1])


@needs_kernel
def test_the_packed_layers_attend_by_these_kernels_unless_told_otherwise(monkeypatch):
    from cat_fast.layers import packing

    H, D, lengths, p = 2, 16, [6, 9], 0.25
    cu = _offsets(lengths)
    q, k, v = _inputs(15, 15, H, D, torch.float32, 10)
    torch.manual_seed(4)  # the key is drawn from the device's generator: drawn again below
    out, saved = packing.varlen_forward(q, k, v, cu, cu, 9, 9, p, 0.25)
    own, lse, bits, _ = saved
    assert own is va and bits is not None
    torch.manual_seed(4)
    want, want_lse, want_bits = va.forward(q, k, v, cu, cu, 9, 9, 0.25, p, va.draw_key(DEVICE), covered=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert torch.equal(bits, want_bits)
    do = torch.randn_like(out)
    got = packing.varlen_backward(do, q, k, v, out, saved, cu, cu, 9, 9, p, 0.25)
    for a, b in zip(got, va.backward(do, q, k, v, want, want_lse, cu, cu, 9, 9, 0.25, p, want_bits, covered=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    monkeypatch.setattr(packing, "VARLEN_KERNEL", "flash")
    assert packing._own_varlen(q, p) is None
    monkeypatch.setattr(packing, "VARLEN_KERNEL", "Triton")
    with pytest.raises(ValueError, match="VARLEN_KERNEL: expected 'triton' or 'flash', got 'Triton'"):
        packing.varlen_forward(q, k, v, cu, cu, 9, 9, p, 0.25)
    monkeypatch.setattr(packing, "VARLEN_KERNEL", "triton")
    assert packing._own_varlen(q, 0.001) is None  # a rate these kernels would round to 0: flash attention's
    assert packing._own_varlen(q.new_zeros(4, 2, 24), 0.0) is None  # a head width they do not take
    # sequences whose rows the kernels' 32-bit offsets do not reach: flash attention's
    rows = -(-2 ** 31 // q.stride(0))
    assert packing._own_varlen(q, p, rows - 1) is va and packing._own_varlen(q, p, rows) is None
