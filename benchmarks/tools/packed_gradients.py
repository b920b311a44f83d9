"""Two pieces of the packed training layers' backward (`cat_fast.layers.packing`), each beside the form it
replaced, at about the packed rows of the step suite's batches (BERT-base, D = 768; ``--rows``, by default 3,200
and 12,800: 32x128 and 64x256 with ~76 % real tokens, rounded up to a bucket):

- the join of variable-length attention's dq, dk and dv with the query, key and value bias gradient:
  `kernels.triton.column_sums.concat` (one pass) against ``torch.cat`` then `column_sums.column_sums` of the joined
  gradient (the second pass it saves);
- the gradient of the first packed layer's input through `packing.pack` and the last `packing.unpack` (fp32, the
  batch's B·T rows; the pair's forward, the same in both, is timed with it): linked (the unpack hands the full
  gradient to its pack, which writes its rows into it) against unlinked (each makes its own full tensor, autograd
  adds them).

Each version runs 20 times inside one CUDA graph, median of 7 replays, µs per call, and the bytes it must move over
the time as a fraction of the memory bandwidth (``--peak-tbs``, the H200's 4.8 TB/s by default); the results of
each pair are compared first. GPU only.

    python benchmarks/tools/packed_gradients.py [--rows 3200 12800] [--peak-tbs 4.8]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
from benchmarks.tools.row_kernels import graph_time_us  # noqa: E402
from cat_fast.kernels.triton import column_sums as cs  # noqa: E402
from cat_fast.layers import packing  # noqa: E402

D = 768
# B x T of the step suite whose real tokens, rounded up to a bucket, are about the default rows
BATCHES = {3200: (32, 128), 12800: (64, 256)}


def _line(name, rows, us, moved, peak):
    return f"{rows} rows, {name}: {us:.1f} us, {moved / (us * 1e-6) / (peak * 1e12):.0%} of {peak} TB/s"


def _join(rows, peak):
    parts = [torch.randn(rows, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    joined, sums = cs.concat(parts)
    want = torch.cat(parts, 1)
    assert torch.equal(joined, want)
    torch.testing.assert_close(sums, cs.column_sums(want.unsqueeze(0), 3 * D)[0], rtol=1e-5, atol=1e-3)
    moved = 2 * rows * 3 * D * 2  # read the parts, write the join (16-bit)
    ours = graph_time_us(lambda: cs.concat(parts))
    theirs = graph_time_us(lambda: cs.column_sums(torch.cat(parts, 1).unsqueeze(0), 3 * D))
    print(_line("dq/dk/dv join + bias sums, concat", rows, ours, moved, peak), flush=True)
    print(_line("torch.cat + column_sums", rows, theirs, moved, peak) + f" ({theirs / ours:.2f}x)", flush=True)


def _pack_unpack(rows, peak):
    B, T = BATCHES.get(rows) or (-(-rows // 96), 128)  # other counts: rows of 128 with 3/4 real
    real = torch.zeros(B, T, dtype=torch.bool, device="cuda")
    real.view(-1)[torch.randperm(B * T, device="cuda")[:min(rows, B * T)]] = True
    real[:, 0] = True
    mask = real[:, None, None, :] & torch.ones(T, 1, dtype=torch.bool, device="cuda")
    plan = packing.plan(mask, B, T, 0.0)
    hidden = torch.randn(B, T, D, device="cuda", requires_grad=True)
    grad = torch.randn(B, T, D, device="cuda")
    results, times = {}, {}
    for linked in (True, False):
        def forward_backward(linked=linked):
            packed = packing.pack(hidden, plan)
            out = packing.unpack(packed * 2.0, plan, hidden, packing.link(packed) if linked else None)
            return torch.autograd.grad(out, hidden, grad)[0]

        results[linked] = forward_backward()
        times[linked] = graph_time_us(forward_backward)
    assert torch.equal(results[True], results[False])
    n = plan.idx.numel()
    # the backward's least traffic: the full gradient read and written once, the rows gathered and written
    moved = (2 * B * T + 4 * n) * D * 4
    print(_line(f"pack/unpack input gradient ({B}x{T}), linked", n, times[True], moved, peak), flush=True)
    print(_line("unlinked", n, times[False], moved, peak) + f" ({times[False] / times[True]:.2f}x)", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--peak-tbs", type=float, default=4.8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("packed_gradients.py needs a CUDA device")
    torch.manual_seed(0)
    for rows in args.rows:
        _join(rows, args.peak_tbs)
        _pack_unpack(rows, args.peak_tbs)


if __name__ == "__main__":
    main()
