"""Kernel-only timings of the cmix kernels (no Python wrapper, no autograd), against a device copy.

CUDA events around each call, median, timed as the op-level suite times (`benchmarks._harness.time_cuda`: the GPU is kept
ahead of the host, and L2 is evicted by reading 256 MiB before each call, so it holds no input and no dirty line).
The same kernels and the 512 MiB copy are also timed with `triton.testing.do_bench`, whose L2 flush writes 256 MB:
the write-back of those dirty lines then lands inside the timed call (the `do_bench` columns). Separates kernel
time from the host overhead that the op-level suite includes. Before timing, the kernels are checked against a
float64 computation on shapes that reach every CUDA path (tile kernels with one or several d-splits per token, the
row-kernel fallbacks for B > 256 and for D not a multiple of the 16-byte pack), and the backward is checked to be
bitwise deterministic. Usage on a GPU: python benchmarks/tools/kernel_only.py [--no-check]
"""
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
import cat_fast  # noqa: E402
from benchmarks import _harness as H  # noqa: E402
from cat_fast.ops import registry as _registry  # noqa: E402

REPS = 50

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}

# (B, T, D, per_token, partner kind): tile path (S = 1 and S > 1), ragged chunks, B = 256, and fallbacks.
CHECK_CASES = [
    (64, 512, 1024, False, "permutation"),
    (64, 300, 1024, True, "repeats"),
    (64, 7, 1024, False, "permutation"),  # small T: d split over several blocks + split sum
    (256, 9, 512, True, "repeats"),
    (33, 5, 200, True, "permutation"),  # 25 bf16 packs / 50 fp32 packs per row: ragged last chunk
    (1, 1, 8, False, "permutation"),
    (4, 17, 64, True, "repeats"),
    (300, 3, 64, False, "repeats"),  # B > 256: row kernels
    (5, 3, 130, True, "repeats"),  # D not a multiple of the pack: row kernels
]


def _inputs(B, T, D, dtype, per_token, kind, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(B, T, D, device="cuda", dtype=dtype, generator=g)
    grad = torch.randn(B, T, D, device="cuda", dtype=dtype, generator=g)
    lam = torch.rand((B, T) if per_token else (B,), device="cuda", generator=g)
    if kind == "permutation":
        partner = torch.randperm(B, device="cuda", generator=g)
    else:
        partner = torch.randint(0, max(B // 2, 1), (B,), device="cuda", generator=g)
    return h, grad, lam, partner


def _float64(h, grad, lam, partner):
    h, grad, lam = h.double(), grad.double(), lam.double()
    l = lam.reshape(lam.shape[0], -1, 1)  # noqa: E741
    out = l * h[partner] + (1 - l) * h
    grad_h = ((1 - l) * grad).index_add(0, partner, l * grad)
    grad_lam = ((h[partner] - h) * grad).sum(-1)
    return out, grad_h, grad_lam


def check(kernels):
    for B, T, D, per_token, kind in CHECK_CASES:
        for dtype, tol in TOLERANCE.items():
            h, grad, lam, partner = _inputs(B, T, D, dtype, per_token, kind)
            out = kernels.cmix_forward(h, lam, partner)
            grad_h, grad_lam = kernels.cmix_backward(grad, h, lam, partner)
            grad_h2, grad_lam2 = kernels.cmix_backward(grad, h, lam, partner)
            want = _float64(h, grad, lam, partner)
            for name, got, ref in zip(("out", "grad_h", "grad_lam"), (out, grad_h, grad_lam), want):
                # grad_lam sums D products: scale the tolerance by sqrt(D)
                scale = D**0.5 if name == "grad_lam" else 1.0
                torch.testing.assert_close(got.double(), ref, rtol=tol * scale, atol=tol * scale,
                                           msg=lambda m: f"{name} {B}x{T}x{D} {dtype} {kind} per_token={per_token}: {m}")
            assert torch.equal(grad_h, grad_h2) and torch.equal(grad_lam, grad_lam2), f"nondeterministic {B}x{T}x{D} {dtype}"
    print(f"check: {len(CHECK_CASES)} shapes x {len(TOLERANCE)} dtypes match float64, backward bitwise deterministic")


def _ms(fn, do_bench=False):
    if do_bench:
        return triton.testing.do_bench(fn, return_mode="median")
    return H.time_cuda(fn, warmup=5, reps=REPS, host_ahead=True)[0]


def copy_gbps(do_bench=False):
    """Device-to-device copy bandwidth of a 512 MiB buffer (bytes read + written), median."""
    src = torch.zeros(512 * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / _ms(lambda: dst.copy_(src), do_bench) / 1e6


def time_fwd_bwd(kernels, h, grad, lam, partner, do_bench=False):
    """Milliseconds (median) of the cmix forward and backward kernels."""
    fwd = _ms(lambda: kernels.cmix_forward(h, lam, partner), do_bench)
    bwd = _ms(lambda: kernels.cmix_backward(grad, h, lam, partner), do_bench)
    return fwd, bwd


def _report(backend, dtype, times, nbytes, copy_bw, label=""):
    """times: (fwd, bwd) ms, then the do_bench (fwd, bwd) ms or None; copy_bw likewise (GB/s, do_bench GB/s)."""
    (fwd, bwd), bench = times
    # minimal traffic: forward reads h, writes h_mix (2N); backward reads grad and h, writes grad_h (3N)
    rows = (("forward", 0, 2), ("backward", 1, 3), ("fwd+bwd", None, 5))
    for name, i, n in rows:
        ms = fwd + bwd if i is None else (fwd, bwd)[i]
        bw = n * nbytes / ms / 1e6
        line = (f"cmix {name:8s} {backend:6s} {str(dtype):15s} {ms * 1e3:8.1f} us {bw:8,.0f} GB/s "
                f"{100 * bw / copy_bw[0]:5.1f}% of copy")
        if bench is not None:
            ms_b = sum(bench) if i is None else bench[i]
            bw_b = n * nbytes / ms_b / 1e6
            line += f" | do_bench {ms_b * 1e3:6.1f} us {100 * bw_b / copy_bw[1]:5.1f}%"
        print(line + (f"  {label}" if label else ""))


def main():
    B, T, D = 64, 512, 1024
    copy_bw = (copy_gbps(), copy_gbps(do_bench=True))
    print(f"copy bandwidth {copy_bw[0]:,.0f} GB/s (read + write; 512 MiB; L2 evicted clean before each call) | "
          f"do_bench {copy_bw[1]:,.0f} GB/s (L2 flushed by writing 256 MB)")
    if "--no-check" not in sys.argv and "cuda" in cat_fast.backends():
        check(_registry.kernels("cuda"))
    for dtype in (torch.bfloat16, torch.float32):
        h = torch.randn(B, T, D, device="cuda", dtype=dtype)
        grad = torch.randn_like(h)
        lam = torch.rand(B, device="cuda")
        partner = torch.randperm(B, device="cuda")
        for backend in ("cuda", "triton"):
            if backend in cat_fast.backends():
                kernels = _registry.kernels(backend)
                times = (time_fwd_bwd(kernels, h, grad, lam, partner),
                         time_fwd_bwd(kernels, h, grad, lam, partner, do_bench=True))
                _report(backend, dtype, times, h.numel() * h.element_size(), copy_bw)
    # other shapes / lambda kinds, cuda only (same traffic model)
    if "cuda" in cat_fast.backends():
        kernels = _registry.kernels("cuda")
        for (b, t, d, per_token, kind) in ((64, 512, 1024, True, "repeats"), (256, 128, 1024, False, "permutation"),
                                           (64, 64, 1024, False, "permutation"), (32, 512, 4096, False, "permutation")):
            for dtype in (torch.bfloat16, torch.float32):
                h, grad, lam, partner = _inputs(b, t, d, dtype, per_token, kind)
                times = (time_fwd_bwd(kernels, h, grad, lam, partner), None)
                label = f"[{b},{t},{d}] {'per-token' if per_token else 'per-sample'} {kind}"
                _report("cuda", dtype, times, h.numel() * h.element_size(), copy_bw, label)


if __name__ == "__main__":
    main()
