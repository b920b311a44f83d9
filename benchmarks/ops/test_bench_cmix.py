"""cmix (CMIX interpolation of hidden states, SPEC §1.1): forward + backward w.r.t. h and per-sample lam.

h [B, T, D] in fp32 / bf16, lam [B] float32, partner a permutation, mask=None (the mask is a tiny [B, T]
op outside the kernel). Minimal bytes (s = element size of h, n = B*T*D):
forward  = read h + write h_mix                                  = 2 n s (+ lam, partner)
backward = read grad, read h, write grad_h (+ write grad_lam [B]) = 3 n s (+ lam, partner)
"""
import pytest
import torch

from benchmarks.ops import harness as H

pytestmark = pytest.mark.benchmark(timer=H.virtual_clock)


@pytest.mark.parametrize(H.OP_ARGNAMES, H.op_params(H.SIZES_BTD_GPU, H.SIZES_BTD_CPU))
def test_cmix(benchmark, copy_bandwidth, device, backend, size, dtype):
    batch, tokens, hidden, h = H.hidden_case(size, device, dtype)
    lam = torch.rand(batch, device=device, requires_grad=True)
    partner = torch.randperm(batch, device=device)
    grad_out = torch.randn(batch, tokens, hidden, device=device, dtype=h.dtype)
    n, s = h.numel(), h.element_size()
    measure = H.op_measure(
        "cmix", backend, device,
        forward=lambda fn: fn(h, lam, partner)[0],
        grad_inputs=(h, lam), grad_outputs=grad_out,
        bytes_fwd=2 * n * s + batch * (4 + 8),
        bytes_bwd=3 * n * s + batch * (4 + 4 + 8),
    )
    H.finish(H.record(benchmark, measure, group="cmix", shape=size, dtype=dtype))
