"""cal_step_ (one in-place CAL ascent step on lambda, SPEC §1.2): lam [B] (p = 1) or [B, T] (p = 2, row norms).

No backward (an in-place no-grad update). lam, grad float32. Minimal bytes: read lam, grad, write lam
= 3 * 4 * numel. Kernel launches per call are counted (target: 1).
"""
import pytest
import torch

from benchmarks.ops import harness as H

pytestmark = pytest.mark.benchmark(timer=H.virtual_clock)

SIZES_GPU = ("32", "64", "32x128", "64x256", "64x512")
SIZES_CPU = ("8", "8x64")


@pytest.mark.parametrize(H.OP_ARGNAMES, H.op_params(SIZES_GPU, SIZES_CPU, gpu_dtypes=("fp32",)))
def test_cal_step(benchmark, copy_bandwidth, device, backend, size, dtype):
    shape = H.dims(size)
    p = 1.0 if len(shape) == 1 else 2.0
    torch.manual_seed(0)
    lam = torch.rand(shape, device=device, dtype=H.DTYPES[dtype])
    grad = torch.randn(shape, device=device, dtype=lam.dtype)
    measure = H.op_measure(
        "cal_step_", backend, device,
        forward=lambda fn: fn(lam, grad, 2e-2, p, 0.0, 1.0),
        bytes_fwd=3 * lam.numel() * lam.element_size(),
        count_launches=True,
    )
    H.finish(H.record(benchmark, measure, group="cal_step_", shape=size, dtype=dtype, p=p))
