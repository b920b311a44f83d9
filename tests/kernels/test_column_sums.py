"""cat_fast.kernels.triton.column_sums (adds the row-sum kernels' partial sums) against torch.sum. On the CPU
the Triton kernel runs under the interpreter."""
import os

import pytest
import torch

pytest.importorskip("triton")
from cat_fast.kernels.triton.column_sums import column_sums  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("groups,rows,width,n", [(3, 37, 1024, 768), (1, 1, 8, 5), (1, 300, 3072, 3072),
                                                 (2, 5, 130, 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_torch_sum(groups, rows, width, n, dtype):
    g = torch.Generator().manual_seed(rows)
    part = torch.randn(groups, rows, width, generator=g, dtype=dtype).to(DEVICE)
    part[..., n:] = float("nan")  # past n: never read
    got = column_sums(part, n)
    assert got.shape == (groups, n) and got.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, part[:, :, :n].sum(1), rtol=tol, atol=tol * rows)


@pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
def test_strided_groups_nan_and_empty():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 9, 40, generator=g).to(DEVICE)
    part = base[::2]  # groups 2 apart: not contiguous, unit column stride
    assert not part.is_contiguous()
    torch.testing.assert_close(column_sums(part, 33), part[:, :, :33].sum(1), rtol=1e-5, atol=1e-5)
    part = base.transpose(1, 2)  # column stride not 1: copied first
    torch.testing.assert_close(column_sums(part, 7), part[:, :, :7].sum(1), rtol=1e-5, atol=1e-5)
    nan = base.clone()
    nan[1, 4, 3] = float("nan")
    out = column_sums(nan, 40)
    assert torch.isnan(out[1, 3]) and torch.isfinite(out[0]).all() and torch.isfinite(out[1, 4:]).all()
    assert column_sums(base[:, :0], 40).eq(0).all() and column_sums(base, 0).shape == (6, 0)


@pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("rows,n", [(4096, 40), (3001, 70)])
def test_long_sums_split_over_programs_and_16_bit_input(rows, n):
    # many rows: summed in two launches (the rows split over programs, then the partial sums); 16-bit input
    # (a bias gradient) accumulated in fp32
    g = torch.Generator().manual_seed(rows)
    part = torch.randn(1, rows, n, generator=g).to(DEVICE)
    torch.testing.assert_close(column_sums(part, n), part.sum(1), rtol=1e-5, atol=1e-4)
    half = part.to(torch.bfloat16)
    got = column_sums(half, n)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, half.float().sum(1), rtol=1e-5, atol=1e-4)


def test_a_tensor_that_is_not_3_d_is_refused():
    with pytest.raises(ValueError, match=r"part: expected a 3-D tensor \[groups, rows, columns\], got shape \(3, 4\)"):
        column_sums(torch.randn(3, 4), 4)


@pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("rows,width", [(70, 24), (1, 5), (33, 130)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_concat_joins_three_parts_and_sums_the_columns_in_the_same_pass(rows, width, dtype, monkeypatch):
    from cat_fast.kernels.triton.column_sums import LAUNCH, concat
    monkeypatch.setitem(LAUNCH, "concat_rows", 8)  # several programs and tiles on few rows: partial sums added
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 4 * width, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)
    parts = (wide[:, :width], wide[:, 2 * width:3 * width], wide[:, width:2 * width].clone())  # row strides differ
    joined, sums = concat(parts)
    want = torch.cat(parts, 1)
    assert joined.dtype == dtype and torch.equal(joined, want)
    assert sums.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(sums, want.to(sums.dtype).sum(0), rtol=tol, atol=tol * rows)
    only, none = concat(parts, want_sums=False)
    assert none is None and torch.equal(only, want)


@pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("want_sums", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_concat_puts_the_second_and_third_parts_back_in_order_by_gather(want_sums, dtype, monkeypatch):
    """`concat(..., gather=g)`: output row i holds the first part's row i and row g[i] of the other two (zeros
    where g[i] is -1), as flash attention's key and value gradients go back to the packed rows' order; the sums are
    those of the joined result. A gather of another shape, dtype or device is named."""
    from cat_fast.kernels.triton.column_sums import LAUNCH, concat
    monkeypatch.setitem(LAUNCH, "concat_rows", 8)
    g = torch.Generator().manual_seed(2)
    n, width = 45, 36
    parts = [torch.randn(n, width, generator=g, dtype=torch.float64).to(dtype).to(DEVICE) for _ in range(3)]
    order = torch.randperm(n, generator=g)
    gather = order.masked_fill(order >= 38, -1).to(DEVICE)  # 7 rows of no key
    joined, sums = concat(parts, want_sums=want_sums, gather=gather)
    moved = [torch.where(gather[:, None] >= 0, p[gather.clamp(min=0)], torch.zeros_like(p)) for p in parts[1:]]
    want = torch.cat([parts[0], *moved], 1)
    assert torch.equal(joined, want) and joined[gather < 0, width:].eq(0).all()
    if want_sums:
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(sums, want.to(sums.dtype).sum(0), rtol=tol, atol=tol * n)
    else:
        assert sums is None
    assert torch.equal(concat(parts, want_sums=False, gather=gather.int())[0], want)
    for bad in (gather[:-1], gather.float(), gather.view(5, 9)):
        with pytest.raises(ValueError, match=r"gather: expected an int32 or int64 tensor of shape \(45,\)"):
            concat(parts, gather=bad)


@pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
def test_concat_of_column_strided_and_empty_parts_and_bad_parts_named():
    from cat_fast.kernels.triton.column_sums import concat
    g = torch.Generator().manual_seed(5)
    parts = [torch.randn(6, 9, generator=g, dtype=torch.float64).to(DEVICE) for _ in range(3)]
    strided = [p.t().contiguous().t() for p in parts]  # column stride 6: copied first
    joined, sums = concat(strided)
    assert torch.equal(joined, torch.cat(parts, 1))
    torch.testing.assert_close(sums, torch.cat(parts, 1).sum(0), rtol=1e-12, atol=1e-12)
    joined, sums = concat([p[:0] for p in parts])
    assert joined.shape == (0, 27) and sums.shape == (27,) and sums.eq(0).all()
    with pytest.raises(ValueError, match="parts: expected three 2-D tensors"):
        concat(parts[:2])
    with pytest.raises(ValueError, match=r"parts: expected one shape, dtype and device, got \[\(\(6, 9\)"):
        concat([parts[0], parts[1][:, :8], parts[2]])
