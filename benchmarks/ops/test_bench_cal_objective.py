"""cal_objective (per-sample CAL objective gamma * CE + eta * max softmax, SPEC §1.2) on logits [N, C].

N = B rows with C = 2..3 (training), B*T rows x 3 and 2^20 x 3 (bandwidth). Backward w.r.t. logits.
Minimal bytes (s = element size): forward = read logits N C s + labels 8 N, write out 4 N;
backward = read grad 4 N, logits N C s, labels 8 N, write grad_logits N C s.
Kernel launches per direction are counted with torch.profiler (target: 1 each).
"""
import pytest
import torch

from benchmarks.ops import harness as H

pytestmark = pytest.mark.benchmark(timer=H.virtual_clock)


@pytest.mark.parametrize(H.OP_ARGNAMES, H.op_params(H.SIZES_NC_GPU, H.SIZES_NC_CPU))
def test_cal_objective(benchmark, copy_bandwidth, device, backend, size, dtype):
    rows, classes, logits = H.logits_case(size, device, dtype)
    labels = torch.randint(0, classes, (rows,), device=device)
    grad_out = torch.randn(rows, device=device)
    s = logits.element_size()
    measure = H.op_measure(
        "cal_objective", backend, device,
        forward=lambda fn: fn(logits, labels, 10.0, 20.0),
        grad_inputs=(logits,), grad_outputs=grad_out,
        bytes_fwd=rows * classes * s + rows * (8 + 4),
        bytes_bwd=2 * rows * classes * s + rows * (4 + 8),
        count_launches=True,
    )
    H.finish(H.record(benchmark, measure, group="cal_objective", shape=size, dtype=dtype))
