"""What the plain fast step's matrix work alone takes on this GPU: each matmul of the step (forward, input
gradient, weight gradient accumulated in fp32), PyTorch's variable-length flash attention (forward and backward)
and the fused AdamW update, timed in isolation at the shapes of the step suite's batch, summed per step, and the
fraction of the bf16 matmul peak that sum would reach over the real tokens' matmul FLOPs (`benchmarks.steps.flops`
counting). A step cannot beat this sum without faster kernels: the LayerNorms, GELU, dropout and residual adds come
on top. Prints one JSON record per size.

    python benchmarks/tools/matmul_ceiling.py 64x256 32x128 --peak 989
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
from benchmarks.tools import size_arg  # noqa: E402


def _time(fn, reps: int) -> float:
    """GPU ms of one call of `fn`: `reps` calls back to back in one CUDA graph (no launch or host time between the
    kernels, as in a captured step), the median of 7 replays (`row_kernels.graph_time_us`)."""
    from benchmarks.tools.row_kernels import graph_time_us

    return graph_time_us(fn, calls=reps) / 1e3


def _products(n, b, D, inner, heads_width):
    """``(name, m, k, n, count, kind)`` of one step's matmuls over `n` packed rows and `b` sequences: the Bert
    layer's four projections (query/key/value as one), each forward, input gradient and fp32 weight gradient, for
    the full layers; the first-token last layer's keys and values over every row and its row-0 products."""
    qkv = 3 * heads_width
    full = [("qkv", D, qkv), ("attention output", heads_width, D), ("intermediate", D, inner), ("output", inner, D)]
    out = []
    for name, k_in, k_out in full:
        out += [(f"{name} forward", n, k_in, k_out, "fwd"), (f"{name} input grad", n, k_out, k_in, "dx"),
                (f"{name} weight grad", k_out, n, k_in, "dw")]
    last = [("last: key/value forward", n, D, 2 * heads_width, "fwd"), ("last: key/value input grad", n,
            2 * heads_width, D, "dx"), ("last: key/value weight grad", 2 * heads_width, n, D, "dw")]
    for name, k_in, k_out in [("query", D, heads_width), ("attention output", heads_width, D),
                              ("intermediate", D, inner), ("output", inner, D)]:
        last += [(f"last: {name} forward", b, k_in, k_out, "fwd"), (f"last: {name} input grad", b, k_out, k_in, "dx"),
                 (f"last: {name} weight grad", k_out, b, k_in, "dw")]
    return out, last


def _matmul_ms(m, k, n, kind, reps):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if kind == "dw":  # gradientᵀ @ input, as the training layer's backward: [k_out, N] (transposed view) @ [N, k_in]
        a = torch.randn(k, m, device="cuda", dtype=torch.bfloat16).t()
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        return _time(lambda: torch.mm(a, b, out_dtype=torch.float32), reps)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)  # the weight as stored, used transposed (x Wᵀ)
    if kind == "fwd":
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        return _time(lambda: torch.addmm(bias, a, w.t()), reps)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)  # dx = g W
    return _time(lambda: torch.mm(a, w), reps)


def _attention_ms(lengths, heads, width, reps):
    """Forward and backward ms of PyTorch's variable-length flash attention over sequences of `lengths`."""
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
    n, T = int(cu[-1]), max(lengths)
    q, k, v = (torch.randn(n, heads, width, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = width ** -0.5

    def forward():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, T, T, 0.0, False, False, scale=scale)

    out, lse, rng, unused, _ = forward()
    grad = torch.randn_like(out)

    def backward():
        return torch.ops.aten._flash_attention_backward(grad, q, k, v, out, lse, cu, cu, T, T, 0.0, False, rng,
                                                        unused, scale=scale)

    return _time(forward, reps), _time(backward, reps)


def _adamw_ms(model, reps):
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=torch.tensor(1e-5, device="cuda"), fused=True, capturable=True)
    return _time(opt.step, reps)


def ceiling(size: str, peak: float, reps: int) -> dict:
    from benchmarks.steps.flops import model_flops
    from benchmarks.steps.harness import make_batch, make_model

    B, T = (int(v) for v in size.split("x"))
    model = make_model("sdpa")
    config = model.config
    batch, _ = make_batch(B, T, config.vocab_size, device="cpu")
    lengths = [int(v) for v in batch["attention_mask"].sum(1)]
    n = sum(lengths)
    D, inner, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads = config.num_attention_heads
    width = D // heads
    full, last = _products(n, B, D, inner, D)
    rows = []
    per_step = 0.0
    for name, m, k, nn, kind in full:
        ms = _matmul_ms(m, k, nn, kind, reps)
        rows.append({"product": name, "shape": [m, k, nn], "ms": round(ms, 4), "count": L - 1,
                     "tflop_per_s": round(2 * m * k * nn / ms / 1e9, 1)})
        per_step += (L - 1) * ms
    for name, m, k, nn, kind in last:
        ms = _matmul_ms(m, k, nn, kind, reps)
        rows.append({"product": name, "shape": [m, k, nn], "ms": round(ms, 4), "count": 1,
                     "tflop_per_s": round(2 * m * k * nn / ms / 1e9, 1)})
        per_step += ms
    fwd, bwd = _attention_ms(lengths, heads, width, reps)
    attention = (L - 1) * (fwd + bwd)
    adamw = _adamw_ms(model, reps)
    # matmul FLOPs over the real tokens: each sequence its own length, as the RESULTS' peak row counts them
    flops = sum(model_flops(config, 1, t, "plain_fast_captured") for t in lengths)
    matmuls = per_step + attention
    return {"size": size, "real_tokens": n, "tflop_per_step": round(flops / 1e12, 3),
            "matmul_ms": round(per_step, 3), "attention_ms": round(attention, 3),
            "attention_fwd_bwd_ms_per_layer": [round(fwd, 4), round(bwd, 4)], "adamw_ms": round(adamw, 3),
            "matmuls_and_attention_fraction_of_peak": round(flops / (matmuls / 1e3) / 1e12 / peak, 3),
            "with_adamw_fraction_of_peak": round(flops / ((matmuls + adamw) / 1e3) / 1e12 / peak, 3),
            "products": rows}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="+", type=size_arg, help="BxT, e.g. 64x256")
    parser.add_argument("--peak", type=float, default=989.0, help="the GPU's dense bf16 matmul peak, TFLOP/s")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("matmul_ceiling: needs a CUDA GPU", file=sys.stderr)
        return 2
    for size in args.sizes:
        print(json.dumps(ceiling(size, args.peak, args.reps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
