"""The bias-model losses (docs/METHODS.md §4) on logits [N, C], mean reduction: poe_loss, reweighted_loss,
learned_mixin_loss (gate [N] gets a gradient too), conf_reg_loss.

bias, teacher_probs and gate float32 (as a bias file and a linear head give them). Minimal bytes (s = element size of
the logits): forward = read logits N C s, bias 4 N C, labels 8 N (+ gate 4 N, + teacher 4 N C), write the scalar;
backward = the same reads + write grad_logits N C s (+ grad_gate 4 N). Kernel launches per direction are counted
(target: 1 each).
"""
import pytest
import torch

from benchmarks.ops import harness as H

pytestmark = pytest.mark.benchmark(timer=H.virtual_clock)

LOSSES = ("poe_loss", "reweighted_loss", "learned_mixin_loss", "conf_reg_loss")


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize(H.OP_ARGNAMES, H.op_params(H.SIZES_NC_GPU, H.SIZES_NC_CPU))
def test_bias_loss(benchmark, copy_bandwidth, device, backend, size, dtype, loss):
    rows, classes, logits = H.logits_case(size, device, dtype)
    bias = torch.log_softmax(3 * torch.randn(rows, classes, device=device), -1)
    teacher = torch.softmax(2 * torch.randn(rows, classes, device=device), -1)
    gate = torch.randn(rows, device=device, requires_grad=True)
    labels = torch.randint(0, classes, (rows,), device=device)
    grad_out = torch.ones((), device=device)
    s = logits.element_size()
    reads = rows * classes * (s + 4) + rows * 8
    forward = {
        "poe_loss": lambda fn: fn(logits, bias, labels),
        "reweighted_loss": lambda fn: fn(logits, bias, labels),
        "learned_mixin_loss": lambda fn: fn(logits, bias, labels, gate),
        "conf_reg_loss": lambda fn: fn(logits, bias, labels, teacher),
    }[loss]
    extra = {"learned_mixin_loss": 4 * rows, "conf_reg_loss": 4 * rows * classes}.get(loss, 0)
    measure = H.op_measure(
        loss, backend, device, forward=forward,
        grad_inputs=(logits, gate) if loss == "learned_mixin_loss" else (logits,), grad_outputs=grad_out,
        bytes_fwd=reads + extra + 4,
        bytes_bwd=reads + extra + rows * classes * s + (4 * rows if loss == "learned_mixin_loss" else 0),
        count_launches=True,
    )
    H.finish(H.record(benchmark, measure, group=f"bias_loss {loss}", shape=size, dtype=dtype))
