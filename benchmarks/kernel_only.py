"""Kernel-only timings of the cmix kernels (no Python wrapper, no autograd), against a device copy.

`triton.testing.do_bench` (CUDA events, median). Separates kernel time from the host overhead that the
op-level suite includes. Usage on a GPU: python benchmarks/kernel_only.py
"""
import torch
import triton.testing

import cat_fast
from cat_fast.ops import _registry


def main():
    B, T, D = 64, 512, 1024
    copy_src = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    copy_ms = triton.testing.do_bench(lambda: copy_dst.copy_(copy_src), return_mode="median")
    copy_bw = 2 * copy_src.numel() / copy_ms / 1e6
    print(f"copy bandwidth {copy_bw:,.0f} GB/s (read + write)")
    for dtype in (torch.bfloat16, torch.float32):
        h = torch.randn(B, T, D, device="cuda", dtype=dtype)
        grad = torch.randn_like(h)
        lam = torch.rand(B, device="cuda")
        partner = torch.randperm(B, device="cuda")
        nbytes = h.numel() * h.element_size()
        for backend in ("cuda", "triton"):
            if backend not in cat_fast.backends():
                continue
            kernels = _registry.kernels(backend)
            fwd = triton.testing.do_bench(lambda: kernels.cmix_forward(h, lam, partner), return_mode="median")
            bwd = triton.testing.do_bench(lambda: kernels.cmix_backward(grad, h, lam, partner), return_mode="median")
            # minimal traffic: forward reads h, writes h_mix (2N); backward reads grad and h, writes grad_h (3N)
            for name, ms, moved in (("forward", fwd, 2 * nbytes), ("backward", bwd, 3 * nbytes), ("fwd+bwd", fwd + bwd, 5 * nbytes)):
                bw = moved / ms / 1e6
                print(f"cmix {name:8s} {backend:6s} {str(dtype):15s} {ms * 1e3:8.1f} us {bw:8,.0f} GB/s {100 * bw / copy_bw:5.1f}% of copy")


if __name__ == "__main__":
    main()
