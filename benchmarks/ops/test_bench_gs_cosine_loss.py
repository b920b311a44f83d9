"""gs_cosine_loss (gradient-supervision loss 1 - cos(g_i, g_hat_i), SPEC §2) on token-level g, g_hat [B, T, D].

Rows are the B samples (T*D values each), reduction mean; backward w.r.t. both g and g_hat.
Minimal bytes (n = B*T*D, s = element size): forward = read g, g_hat = 2 n s;
backward = read g, g_hat, write grad_g, grad_g_hat = 4 n s.
"""
import pytest
import torch

from benchmarks.ops import harness as H

pytestmark = pytest.mark.benchmark(timer=H.virtual_clock)


@pytest.mark.parametrize(H.OP_ARGNAMES, H.op_params(H.SIZES_BTD_GPU, H.SIZES_BTD_CPU))
def test_gs_cosine_loss(benchmark, copy_bandwidth, device, backend, size, dtype):
    batch, tokens, hidden, g = H.hidden_case(size, device, dtype)
    g_hat = torch.randn(batch, tokens, hidden, device=device, dtype=g.dtype, requires_grad=True)
    grad_out = torch.ones((), device=device, dtype=torch.float32)
    n, s = g.numel(), g.element_size()
    measure = H.op_measure(
        "gs_cosine_loss", backend, device,
        forward=lambda fn: fn(g, g_hat, "mean", 1e-8),
        grad_inputs=(g, g_hat), grad_outputs=grad_out,
        bytes_fwd=2 * n * s + 4,
        bytes_bwd=4 * n * s + 4,
    )
    H.finish(H.record(benchmark, measure, group="gs_cosine_loss", shape=size, dtype=dtype))
