"""cat_fast.kernels.triton.row_exchange (the two-rank average of a row-sparse table gradient, for
`gradient_averaging`'s copy exchange) against the plain composition, on one device: the "other rank's" staging is a
second `mark` of another gradient. The two-GPU exchange itself: tests/test_gradient_averaging.py. On the CPU the
Triton kernels run under the interpreter, so the cases stay small."""
import os

import pytest
import torch

pytest.importorskip("triton")
from cat_fast.kernels.triton import row_exchange  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(not RUNS, reason="needs CUDA or TRITON_INTERPRET=1")


def _table(V, H, dtype, rows, seed):
    """A [V, H] gradient that is zero outside `rows` (and has exact zeros inside some of them)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(V, H, dtype=dtype)
    if len(rows):
        out[rows] = torch.randn(len(rows), H, generator=g, dtype=dtype)
        out[rows[:1], : H // 2] = 0  # a touched row partly zero
    return out.to(DEVICE)


def _staged(grad):
    stage = torch.full_like(grad, float("nan"))  # rows `mark` leaves unwritten must never be read
    flags = torch.empty(grad.shape[0], dtype=grad.dtype, device=grad.device)
    row_exchange.mark(grad, stage, flags)
    return stage, flags


@needs_kernels
@pytest.mark.parametrize("V,H", [(37, 24), (1, 5), (64, 130), (9, 1030)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the interpreter casts to bf16 by truncation, the GPU rounds to nearest"))])
def test_the_average_equals_the_scaled_sum_to_the_bit(V, H, dtype):
    own = _table(V, H, dtype, list(range(0, V, 3)), seed=V + H)
    peer = _table(V, H, dtype, list(range(1, V, 4)) + [0], seed=V * H)
    stage, flags = _staged(peer)
    nonzero = (peer != 0).any(1)
    assert torch.equal(flags != 0, nonzero)
    assert torch.equal(stage[nonzero], peer[nonzero])
    out = torch.empty_like(own)
    row_exchange.combine(own, stage, flags, out, 0.5)
    assert torch.equal(out, row_exchange.reference(own, peer, 0.5))
    # the other rank's result, from the other side: the same bits
    own_stage, own_flags = _staged(own)
    other = torch.empty_like(peer)
    row_exchange.combine(peer, own_stage, own_flags, other, 0.5)
    assert torch.equal(other, out)


@needs_kernels
def test_all_zero_tables_nan_rows_in_place_and_strided_rows():
    V, H = 20, 12
    zero = torch.zeros(V, H, device=DEVICE)
    stage, flags = _staged(zero)
    assert not flags.any()  # nothing staged: the stage keeps its NaNs, never read
    own = _table(V, H, torch.float32, [2, 7], seed=1)
    out = own.clone()
    row_exchange.combine(out, stage, flags, out, 0.5)  # in place, the other rank all zeros: own / 2
    assert torch.equal(out, own * 0.5)
    peer = _table(V, H, torch.float32, [3], seed=2)
    peer[5, 4] = float("nan")  # a NaN row is flagged and reaches the average, as in the all-reduce
    stage, flags = _staged(peer)
    assert flags[5] == 1 and flags[3] == 1 and flags.sum() == 2
    wide = torch.zeros(V, 2 * H, device=DEVICE)
    wide[:, :H] = own
    strided = wide[:, :H]  # rows contiguous, row stride 2H
    row_exchange.combine(strided, stage, flags, out, 0.5)
    torch.testing.assert_close(out, row_exchange.reference(own, peer, 0.5), equal_nan=True)
    assert torch.isnan(out[5, 4]) and not torch.isnan(out[6]).any()


@needs_kernels
def test_bad_arguments_are_refused_by_name():
    grad = torch.zeros(6, 4, device=DEVICE)
    stage, flags = torch.zeros_like(grad), torch.zeros(6, device=DEVICE)
    with pytest.raises(ValueError, match="stage: expected a \\(6, 4\\) torch.float32"):
        row_exchange.mark(grad, torch.zeros(6, 5, device=DEVICE), flags)
    with pytest.raises(ValueError, match="flags: expected a \\(6,\\) torch.float32"):
        row_exchange.mark(grad, stage, torch.zeros(6, dtype=torch.int8, device=DEVICE))
    with pytest.raises(ValueError, match="grad: expected a 2-D"):
        row_exchange.mark(grad[0], stage, flags)
    with pytest.raises(ValueError, match="out: expected contiguous rows"):
        row_exchange.combine(grad, stage, flags, torch.zeros(4, 6, device=DEVICE).t(), 0.5)
    with pytest.raises(ValueError, match="peer_flags: expected a \\(6,\\)"):
        row_exchange.combine(grad, stage, flags[:5], grad, 0.5)
