"""crm_loss (clipped importance-weighted CE, SPEC §1.3) on logits, cf_logits [N, C], mean reduction.

Default CAT setting: detach_weight=True (cf_logits get no gradient), a1 = 0, a2 = 10; backward w.r.t.
logits. N as for cal_objective. Minimal bytes (s = element size): forward = read logits, cf_logits
2 N C s + labels 8 N, write the scalar; backward = read both logits 2 N C s + labels 8 N, write
grad_logits N C s. Kernel launches per direction are counted (target: 1 each).
"""
import pytest
import torch

from benchmarks.ops import harness as H

pytestmark = pytest.mark.benchmark(timer=H.virtual_clock)


@pytest.mark.parametrize(H.OP_ARGNAMES, H.op_params(H.SIZES_NC_GPU, H.SIZES_NC_CPU))
def test_crm_loss(benchmark, copy_bandwidth, device, backend, size, dtype):
    rows, classes, logits = H.logits_case(size, device, dtype)
    cf_logits = (3 * torch.randn(rows, classes, device=device)).to(H.DTYPES[dtype])
    labels = torch.randint(0, classes, (rows,), device=device)
    grad_out = torch.ones((), device=device)
    s = logits.element_size()
    measure = H.op_measure(
        "crm_loss", backend, device,
        forward=lambda fn: fn(logits, cf_logits, labels, 0.0, 10.0, True, "mean"),
        grad_inputs=(logits,), grad_outputs=grad_out,
        bytes_fwd=2 * rows * classes * s + rows * 8 + 4,
        bytes_bwd=3 * rows * classes * s + rows * 8 + 4,
        count_launches=True,
    )
    H.finish(H.record(benchmark, measure, group="crm_loss", shape=size, dtype=dtype))
