"""cat_fast.kernels.triton.embedding_backward (an embedding table's weight gradient in a fixed order, for
`layers.embedding`) against PyTorch's ``embedding_dense_backward``. On the CPU the Triton kernels run under the
interpreter, so the cases stay small."""
import os

import pytest
import torch

pytest.importorskip("triton")
from cat_fast.kernels.triton import embedding_backward as emb  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")


def _case(shape, num_weights, dim, dtype, seed=0, ids=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_weights, shape, generator=g) if ids is None else ids
    grad = torch.randn(*ids.shape, dim, generator=g, dtype=dtype)
    return grad.to(DEVICE), ids.to(DEVICE)


@needs_kernels
@pytest.mark.parametrize("shape,num_weights,dim", [((150,), 40, 24), ((3, 37), 500, 33), ((1,), 7, 5),
                                                   ((2, 65), 3, 130)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_pytorch(shape, num_weights, dim, dtype):
    grad, ids = _case(shape, num_weights, dim, dtype)
    got = emb.backward(grad, ids, num_weights)
    want = emb.reference_backward(grad, ids, num_weights)
    assert got.shape == (num_weights, dim) and got.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * 10)


@needs_kernels
@pytest.mark.parametrize("padding_idx", [None, 0, 5, -2])
def test_integer_gradients_are_exact_and_the_padding_row_is_zero(padding_idx):
    # integer-valued gradients: every order of the sums gives the same exact value
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 9, (4, 30), generator=g)
    ids[0, :5] = 0
    grad = torch.randint(-50, 50, (4, 30, 17), generator=g).double()
    got = emb.backward(grad.to(DEVICE), ids.to(DEVICE), 9, padding_idx).cpu()
    want = emb.reference_backward(grad, ids, 9, padding_idx)
    assert torch.equal(got, want)
    if padding_idx is not None:
        assert got[padding_idx % 9].eq(0).all() and not want.eq(0).all()
    assert got[ids.unique()].ne(0).any() and got[[v for v in range(9) if v not in ids]].eq(0).all()


@needs_kernels
@pytest.mark.parametrize("ids", [torch.zeros(70, dtype=torch.long),  # one run over every chunk
                                 torch.tensor([1] * 3 + [2] * 37 + [4] * 9 + [6] * 21),  # runs across chunks
                                 torch.tensor([5, 5, 5, 5, 2, 2, 2, 2, 5, 5, 5, 2])])  # runs over chunk edges
def test_long_runs_sum_their_chunks_tile_by_tile(ids, monkeypatch):
    # small chunks and tiles: a run's first entry adds the partial rows of many chunks over several iterations
    monkeypatch.setitem(emb.LAUNCH, "chunk", 4)
    monkeypatch.setitem(emb.LAUNCH, "tile", 2)
    grad, ids = _case(None, 8, 11, torch.float64, ids=ids)
    torch.testing.assert_close(emb.backward(grad, ids, 8), emb.reference_backward(grad, ids, 8), rtol=1e-12,
                               atol=1e-12)


@needs_kernels
@pytest.mark.parametrize("shape,num_weights,dim,padding_idx", [((2, 65), 3, 130, None), ((1, 7), 2, 9, 0),
                                                               ((3, 20), 1, 5, -1), ((4, 30), 9, 17, -1)])
def test_small_tables_are_summed_without_a_sort_and_agree_with_the_sorted_path(shape, num_weights, dim, padding_idx,
                                                                               monkeypatch):
    # a table of at most LAUNCH["small_table"] rows (here up to 16) skips the sort; integer-valued gradients: every
    # order of the sums gives the same exact value, so both paths and PyTorch's agree bit for bit
    g = torch.Generator().manual_seed(num_weights)
    ids = torch.randint(0, num_weights, shape, generator=g)
    grad = torch.randint(-50, 50, (*shape, dim), generator=g).double()
    want = emb.reference_backward(grad, ids, num_weights, padding_idx)
    monkeypatch.setitem(emb.LAUNCH, "small_table", 16)
    called, small = [], emb._small_table
    monkeypatch.setattr(emb, "_small_table", lambda *a: called.append(1) or small(*a))
    got = emb.backward(grad.to(DEVICE), ids.to(DEVICE), num_weights, padding_idx).cpu()
    assert called and torch.equal(got, want)
    monkeypatch.setitem(emb.LAUNCH, "small_table", 0)
    assert torch.equal(emb.backward(grad.to(DEVICE), ids.to(DEVICE), num_weights, padding_idx).cpu(), want)
    floats = torch.randn(*shape, dim, generator=g, dtype=torch.float64)
    monkeypatch.setitem(emb.LAUNCH, "small_table", 16)
    torch.testing.assert_close(emb.backward(floats.to(DEVICE), ids.to(DEVICE), num_weights, padding_idx).cpu(),
                               emb.reference_backward(floats, ids, num_weights, padding_idx), rtol=1e-12, atol=1e-12)


@needs_kernels
def test_int32_ids_strided_gradient_and_empty_input():
    grad, ids = _case((5, 6), 20, 9, torch.float64)
    strided = grad.transpose(0, 1).contiguous().transpose(0, 1)  # [5, 6, 9] with non-standard strides
    assert not strided.is_contiguous()
    want = emb.reference_backward(grad, ids, 20)
    torch.testing.assert_close(emb.backward(strided, ids.int(), 20), want, rtol=1e-12, atol=1e-12)
    wide = torch.zeros(5, 6, 18, dtype=torch.float64, device=DEVICE)
    wide[..., ::2] = grad  # column stride 2: copied first
    torch.testing.assert_close(emb.backward(wide[..., ::2], ids, 20), want, rtol=1e-12, atol=1e-12)
    empty = emb.backward(grad[:0], ids[:0], 20)
    assert empty.shape == (20, 9) and empty.eq(0).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sizes_of_the_step_suite_in_fp32_bf16_and_the_same_bits_twice():
    for shape, num_weights in (((32, 128), 30522), ((64, 256), 30522), ((64, 256), 2), ((8, 128), 512)):
        grad, ids = _case(shape, num_weights, 768, torch.float32, seed=shape[0])
        ids[:, shape[1] // 2:] = 0  # long runs of one id, as padding gives
        got = emb.backward(grad, ids, num_weights, 0 if num_weights > 2 else None)
        want = emb.reference_backward(grad, ids, num_weights, 0 if num_weights > 2 else None)
        # fp32 sums of up to 16,384 rows in another order than PyTorch's
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * shape[0] * shape[1] ** 0.5)
        assert torch.equal(got, emb.backward(grad, ids, num_weights, 0 if num_weights > 2 else None))
        # 16-bit gradients: summed in fp32, rounded once (PyTorch's own rounds its partial sums too)
        half = grad.bfloat16()
        got = emb.backward(half, ids, num_weights)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), emb.reference_backward(half.float(), ids, num_weights), rtol=4e-3,
                                   atol=1e-3)


def test_bad_arguments_are_named():
    grad = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"grad, ids: expected grad of shape ids.shape \+ \(D,\), got \(4, 3\) for "
                                         r"ids \(5,\)"):
        emb.backward(grad, torch.zeros(5, dtype=torch.long), 10)
    with pytest.raises(ValueError, match="ids: expected int32 or int64, got torch.float32"):
        emb.backward(grad, torch.zeros(4), 10)
    with pytest.raises(ValueError, match="num_weights: expected a positive count below 2\\*\\*31, got 0"):
        emb.backward(grad, torch.zeros(4, dtype=torch.long), 0)
