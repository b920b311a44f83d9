"""The first-token layer's attention (one query per sequence, `cat_fast.layers.attention.first_row`) forward +
backward, side by side: the fused Triton kernels, SDPA as the layer called it before (PyTorch picks its
memory-efficient kernel for one query with a mask), and the plain composition (scores, softmax, keep mask, values)
eager and compiled by ``torch.compile`` (Inductor). BERT-base heads (12 x 64), bf16, HF's float padding mask, at
the batch x length of the step suite, with the attention dropout of training (0.1) and without. Each version runs
20 times inside one CUDA graph (no host in the timing), median of 7 replays; µs per forward + backward, and the
bytes the pair must move (keys and values read twice, their gradients written once) over the time as a fraction of
the GPU's memory bandwidth (``--peak-tbs``, the H200's 4.8 TB/s by default). Each version is checked against the
fused one first (the same keep mask for the composition; SDPA without dropout).

    python benchmarks/tools/first_row_attention.py [--sizes 8x128 32x128 64x256] [--sweep]

``--sweep`` also times the kernels (keep mask given) under each tile length and warp count.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
from benchmarks.tools import size_arg  # noqa: E402
from benchmarks.tools.row_kernels import graph_time_us  # noqa: E402
from cat_fast.kernels.triton import first_row_attention as kernels  # noqa: E402
from cat_fast.layers import attention  # noqa: E402

HEADS, WIDTH = 12, 64


def composition(q, k, v, bias, keep, p, scale):
    B, T, HD = k.shape
    qh = q.view(B, 1, HEADS, WIDTH).transpose(1, 2)
    kh, vh = (t.view(B, T, HEADS, WIDTH).transpose(1, 2) for t in (k, v))
    probs = torch.softmax((qh @ kh.transpose(-1, -2)).float() * scale + bias.float().unsqueeze(2), -1)
    if keep is not None:
        probs = probs * keep.unsqueeze(2) / (1.0 - p)
    return (probs.to(q.dtype) @ vh).transpose(1, 2).reshape(B, 1, HD)


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["8x128", "32x128", "64x256"], type=size_arg,
                        help="batch x length, e.g. 8x128")
    parser.add_argument("--peak-tbs", type=float, default=4.8)
    parser.add_argument("--sweep", action="store_true")
    return parser.parse_args()


def _inputs(B, T, dtype):
    """q, kv, HF's float padding mask and the output gradient of one size."""
    HD = HEADS * WIDTH
    q = torch.randn(B, 1, HD, device="cuda", dtype=dtype)
    kv = torch.randn(B, T, 2 * HD, device="cuda", dtype=dtype)
    mask = torch.zeros(B, 1, 1, T, device="cuda", dtype=dtype)
    for i in range(B):
        mask[i, ..., T - (i * 7) % (T // 2):] = torch.finfo(dtype).min  # padding, as HF's mask has it
    grad = torch.randn(B, 1, HD, device="cuda", dtype=dtype)
    return q, kv, mask, grad


def _versions(q, kv, mask, grad, p, scale, compiled):
    """The versions at dropout `p`, each a call of forward + backward: {name: fn}, the keep mask drawn once."""
    HD = HEADS * WIDTH
    keep = (torch.rand(q.shape[0], HEADS, kv.shape[1], device="cuda") >= p).to(torch.uint8) if p else None
    bias = mask[:, :, 0]

    # each call differentiates w.r.t. new leaves (views of q and kv): no gradient accumulator made outside
    # the capture, whose stream would make the capture depend on the legacy stream
    def leaves():
        q1, kv1 = q.detach().requires_grad_(True), kv.detach().requires_grad_(True)
        return q1, kv1, kv1[..., :HD], kv1[..., HD:]

    def fused_fixed():  # the keep mask given: comparable with the composition
        q1, kv1, _, _ = leaves()
        out = attention.fused_first_row(q1, kv1, bias, HEADS, keep, scale, p)
        return torch.autograd.grad(out, (q1, kv1), grad)

    def fused():  # as the first-token layer calls it: the keep mask drawn (bernoulli_) each call
        q1, kv1, _, _ = leaves()
        return torch.autograd.grad(attention.first_row(q1, kv1, mask, HEADS, p, scale), (q1, kv1), grad)

    def sdpa(p=p):
        q1, kv1, k1, v1 = leaves()
        attention.FUSED = False
        try:
            out = attention.first_row(q1, (k1, v1), mask, HEADS, p, scale)
        finally:
            attention.FUSED = True
        return torch.autograd.grad(out, (q1, kv1), grad)

    def eager(fn=composition):
        q1, kv1, k1, v1 = leaves()
        return torch.autograd.grad(fn(q1, k1, v1, bias, keep.float() if keep is not None else None, p, scale),
                                   (q1, kv1), grad)

    def inductor():
        return eager(compiled)

    return {"fused_fixed": fused_fixed, "fused (Triton)": fused, "SDPA (memory-efficient)": sdpa,
            "eager composition": eager, "torch.compile composition": inductor}


def _check(versions, want, size, p):
    """Each version against the fused kernels (SDPA only without dropout)."""
    checks = ["eager composition", "torch.compile composition"] + ([] if p else ["SDPA (memory-efficient)"])
    for name in checks:
        got = versions[name]()
        ok = all(torch.allclose(a.float(), b.float(), rtol=3e-2, atol=3e-2) for a, b in zip(got, want))
        assert ok, f"{size} p={p}: {name} differs from the fused kernels"


def _report(versions, nbytes, peak_tbs):
    base = None
    for name in ("fused (Triton)", "SDPA (memory-efficient)", "eager composition", "torch.compile composition"):
        us = graph_time_us(versions[name])
        base = base or us
        tbs = nbytes / (us * 1e-6) / 1e12
        print(f"  {name:28s} {us:8.2f} µs  x{us / base:5.2f}  {tbs:5.2f} TB/s "
              f"({100 * tbs / peak_tbs:4.1f} % of peak)", flush=True)


def _sweep(fused_fixed, want):
    """The kernels (keep mask given) under each tile length and warp count."""
    default = kernels.BLOCK_T, kernels.NUM_WARPS
    for block_t in (32, 64, 128):
        for warps in (2, 4, 8):
            kernels.BLOCK_T, kernels.NUM_WARPS = block_t, warps
            try:
                got = fused_fixed()
                ok = all(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)
                         for a, b in zip(got, want))
                print(f"    BLOCK_T {block_t:3d} warps {warps}: {graph_time_us(fused_fixed):8.2f} µs"
                      f"{'' if ok else '  (differs!)'}", flush=True)
            finally:
                kernels.BLOCK_T, kernels.NUM_WARPS = default


def main():
    args = _parse_args()
    torch.manual_seed(0)
    dtype, scale = torch.bfloat16, WIDTH ** -0.5
    compiled = torch.compile(composition, dynamic=False)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; µs per forward + backward (CUDA graph)")
    for size in args.sizes:
        B, T = (int(x) for x in size.split("x"))
        HD = HEADS * WIDTH
        q, kv, mask, grad = _inputs(B, T, dtype)
        nbytes = 2 * (2 * B * T * HD * 2) + B * HEADS * T * (4 + 4 + 1)  # kv read twice, dkv written; scores, keep
        for p in (0.1, 0.0):
            versions = _versions(q, kv, mask, grad, p, scale, compiled)
            want = versions["fused_fixed"]()
            _check(versions, want, size, p)
            print(f"{size} (B={B}, T={T}), dropout {p}:")
            _report(versions, nbytes, args.peak_tbs)
            if args.sweep:
                _sweep(versions["fused_fixed"], want)


if __name__ == "__main__":
    main()
