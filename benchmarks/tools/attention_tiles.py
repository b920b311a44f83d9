"""Tile sizes of the twice-differentiable attention's kernels (`cat_fast.kernels.triton.attention.TILES`): each
backward kernel timed per configuration with the other kernels of its pass at their settings, on the step suite's
64×256 attention shapes by default (bf16, lengths drawn in [T/2, T] and right-padded, attention dropout 0.1, every
cotangent of the double backward given). GPU only.

    python benchmarks/tools/attention_tiles.py [--shape 64,12,256,64] [--kernels dd_rows dkdv dd_cols dq]
        [--seconds 330]

Prints one JSON line per configuration: the kernel, (rows per tile, keys per tile, warps, stages; None: Triton's
default), the pass's time in ms (`triton.testing.do_bench`) and its ratio to the pass with the kernel at TILES'
setting, and the largest difference of the pass's outputs from that setting's (16-bit rounding where a kernel's
sums run in another order); then one line per kernel with the fastest configuration. ``--seconds`` bounds the sweep.
"""
import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
from cat_fast.kernels.triton import attention as kernels  # noqa: E402

ROW_TILES = [(64, 64), (128, 64), (128, 32), (64, 32)]  # a row pass: the program's rows, the keys per loop step
COLUMN_TILES = [(64, 64), (64, 128), (32, 128), (32, 64)]  # a column pass: the rows per loop step, the program's keys


def _passes(B, H, T, D):
    """Each kernel's pass as a call on fixed inputs."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def token_major():
        return torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)

    q, k, v, do, ga, gb, gc = (token_major() for _ in range(7))
    lengths = torch.randint(T // 2, T + 1, (B,), device="cuda", generator=g)
    padding = torch.arange(T, device="cuda")[None] >= lengths[:, None]
    bias = torch.zeros(B, 1, 1, T, device="cuda").masked_fill_(padding[:, None, None, :], float("-inf"))
    bias = bias.expand(B, H, T, T)  # the additive bias the layer hands the kernels
    span = kernels.key_span(bias)
    keep = torch.empty(B, H, T, T, device="cuda", dtype=torch.uint8).bernoulli_(0.9, generator=g)
    scale, inv_keep = D ** -0.5, 1 / 0.9
    out, stats = kernels.forward(q, k, v, bias, keep, span, scale, inv_keep)
    dl = kernels.delta(do, out)

    def backward():
        return kernels.backward(do, q, k, v, stats, dl, bias, keep, span, scale, inv_keep)

    def double_backward():
        return kernels.double_backward(ga, gb, gc, q, k, v, do, stats, dl, bias, keep, span, scale, inv_keep)

    return {"dq": backward, "dkdv": backward, "dd_rows": double_backward, "dd_cols": double_backward}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="64,12,256,64", help="B,H,T,D")
    p.add_argument("--kernels", nargs="+", default=["dd_rows", "dkdv", "dd_cols", "dq"],
                   choices=["dd_rows", "dkdv", "dd_cols", "dq"])
    p.add_argument("--seconds", type=float, default=330.0)
    args = p.parse_args()
    shape = args.shape.split(",")
    if len(shape) != 4 or not all(x.isdigit() and int(x) > 0 for x in shape):
        p.error(f"--shape: expected four positive integers B,H,T,D, got {args.shape!r}")
    if not torch.cuda.is_available():
        sys.exit("attention_tiles.py: needs a CUDA GPU")
    from triton.testing import do_bench

    passes = _passes(*(int(x) for x in shape))
    deadline = time.time() + args.seconds
    for name in args.kernels:
        call = passes[name]
        setting = kernels.TILES.get(name)
        want = call()
        base = do_bench(call, warmup=5, rep=30)
        best = (base, setting)
        tiles = ROW_TILES if name in ("dq", "dd_rows") else COLUMN_TILES
        for (rows, keys), warps, stages in itertools.product(tiles, (4, 8), (None, 2, 4)):
            if time.time() > deadline:
                break
            config = (rows, keys, warps, stages)
            kernels.TILES[name] = config
            try:
                got = call()
                diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
                ms = do_bench(call, warmup=5, rep=30)
            except Exception as e:  # noqa: BLE001 - a tile that does not fit (shared memory) is a row of the table
                print(json.dumps({"kernel": name, "tiles": config, "error": type(e).__name__}), flush=True)
                continue
            finally:
                if setting is None:
                    kernels.TILES.pop(name, None)
                else:
                    kernels.TILES[name] = setting
            print(json.dumps({"kernel": name, "tiles": config, "ms": round(ms, 4), "x_setting": round(ms / base, 3),
                              "max_diff": diff}), flush=True)
            if ms < best[0]:
                best = (ms, config)
        print(json.dumps({"kernel": name, "setting": setting, "setting_ms": round(base, 4), "fastest": best[1],
                          "fastest_ms": round(best[0], 4)}), flush=True)


if __name__ == "__main__":
    main()
