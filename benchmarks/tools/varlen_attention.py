"""cat_fast's variable-length attention (`cat_fast.kernels.triton.varlen_attention`) against PyTorch's flash
attention (`aten._flash_attention_forward` / `_backward`) side by side in one process, at the step suite's batch
lengths (BERT-base's 12 heads of 64, bf16, the packed rows as views of one [N, 3·768] projection): forward and
backward µs (a CUDA graph of back-to-back calls, `row_kernels.graph_time_us`) and TFLOP/s over the real tokens
(forward 4·Σ L²·H·D, backward twice that, as `benchmarks/steps/flops.py` counts), without dropout and at p = 0.1
(cat_fast's forward then includes the kernel that writes the dropout's bits).
``--sweep`` times each kernel's tiles from a short list first and reports the best. GPU only.

    python benchmarks/tools/varlen_attention.py 64x256 32x128 [--sweep]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
from benchmarks.tools import size_arg  # noqa: E402

SWEEP = {"forward": [(64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2), (128, 32, 4, 2)],
         "dkdv": [(32, 64, 4, 2), (64, 64, 4, 2), (32, 128, 4, 2), (32, 64, 4, 3)],
         "dq": [(64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2), (64, 64, 4, 3)]}


def _inputs(size: str, heads: int = 12, width: int = 64):
    from benchmarks.steps.harness import make_batch

    B, T = (int(v) for v in size.split("x"))
    batch, _ = make_batch(B, T, 30522, device="cpu")
    lengths = [int(v) for v in batch["attention_mask"].sum(1)]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
    n = sum(lengths)
    D = heads * width
    qkv = torch.randn(n, 3 * D, device="cuda", dtype=torch.bfloat16)
    q, k, v = (qkv[:, i * D:(i + 1) * D].view(n, heads, width) for i in range(3))
    grad = torch.randn(n, heads, width, device="cuda", dtype=torch.bfloat16)
    flops = 4 * sum(L * L for L in lengths) * D
    return lengths, cu, max(lengths), q, k, v, grad, flops


def measure(size: str, sweep: bool, calls: int = 20) -> dict:
    from benchmarks.tools.row_kernels import graph_time_us
    from cat_fast.kernels.triton import varlen_attention as va

    lengths, cu, T, q, k, v, grad, flops = _inputs(size)
    scale = q.shape[-1] ** -0.5
    record = {"size": size, "real_tokens": sum(lengths), "tflop_forward": round(flops / 1e12, 4)}
    for p in (0.0, 0.1):
        def flash_forward():
            return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, T, T, p, False, False, scale=scale)

        out, lse, rng, unused, _ = flash_forward()

        def flash_backward():
            return torch.ops.aten._flash_attention_backward(grad, q, k, v, out, lse, cu, cu, T, T, p, False, rng,
                                                            unused, scale=scale)

        key = va.draw_key("cuda") if p else None

        def own_forward():
            return va.forward(q, k, v, cu, cu, T, T, scale, p, key, covered=True)

        own_out, own_lse, bits = own_forward()

        def own_backward():
            return va.backward(grad, q, k, v, own_out, own_lse, cu, cu, T, T, scale, p, bits, covered=True)

        if sweep:
            for kind, fn in (("forward", own_forward), ("dkdv", own_backward), ("dq", own_backward)):
                best = None
                for tiles in SWEEP[kind]:
                    va.TILES[kind] = tiles
                    try:
                        us = graph_time_us(fn, calls)
                    except Exception as e:  # a tile that does not fit: reported, skipped
                        record[f"p{p}_{kind}_{tiles}"] = f"{type(e).__name__}: {str(e)[:80]}"
                        continue
                    record[f"p{p}_{kind}_{list(tiles)}"] = round(us, 1)
                    if best is None or us < best[0]:
                        best = (us, tiles)
                va.TILES[kind] = best[1]
                record[f"p{p}_best_{kind}"] = list(best[1])
        times = {"flash_forward": graph_time_us(flash_forward, calls), "flash_backward": graph_time_us(flash_backward,
                                                                                                        calls),
                 "own_forward": graph_time_us(own_forward, calls), "own_backward": graph_time_us(own_backward, calls)}
        for name, us in times.items():
            work = flops if name.endswith("forward") else 2 * flops
            record[f"p{p}_{name}_us"] = round(us, 1)
            record[f"p{p}_{name}_tflop_per_s"] = round(work / us / 1e6, 1)
        record[f"p{p}_speedup_forward"] = round(times["flash_forward"] / times["own_forward"], 3)
        record[f"p{p}_speedup_backward"] = round(times["flash_backward"] / times["own_backward"], 3)
        if not p:
            own_out = own_forward()[0]
            record["p0_max_abs_difference_out"] = (own_out.float() - out.float()).abs().max().item()
    record["tiles"] = {k: list(v) for k, v in va.TILES.items()}
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="+", type=size_arg, help="BxT, e.g. 64x256")
    parser.add_argument("--sweep", action="store_true", help="pick each kernel's tiles from a short list first")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("varlen_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    for size in args.sizes:
        print(json.dumps(measure(size, args.sweep)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
