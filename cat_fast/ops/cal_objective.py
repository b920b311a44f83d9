"""cal_objective: the per-sample CAL objective gamma * CE + eta * max softmax (docs/METHODS.md §1.2)."""
import torch

from ..kernels import reference
from . import registry, validate
from .backend import select

registry.define({
    "cal_objective_forward": "(Tensor logits, Tensor labels, float gamma, float eta) -> Tensor",
    "cal_objective_backward": "(Tensor grad, Tensor logits, Tensor labels, float gamma, float eta) -> Tensor",
}, triton="cal_objective")


def _forward_backward(family):
    def backward(ctx, grad):
        logits, labels = ctx.saved_tensors
        grad_logits = family.cal_objective_backward(grad.contiguous(), logits, labels, ctx.gamma, ctx.eta)
        return grad_logits, None, None, None

    return backward


def _setup(ctx, inputs, output):
    logits, labels, ctx.gamma, ctx.eta = inputs
    ctx.save_for_backward(logits, labels)


registry.register(
    "cal_objective_forward",
    lambda logits, labels, gamma, eta: logits.new_empty(logits.shape[:1], dtype=registry.acc_dtype(logits.dtype)),
    _forward_backward,
    _setup,
)
registry.register(
    "cal_objective_backward",
    lambda grad, logits, labels, gamma, eta: torch.empty_like(logits),
    registry.not_twice_differentiable("cal_objective"),
)


def cal_objective(logits, labels, gamma, eta):
    """Per-sample CAL objective `gamma * CE(logits_i, y_i) + eta * max_c softmax(logits_i)_c`: [B] float32 (float64 for float64 logits)."""
    validate.classes("logits", logits, labels)
    gamma, eta = validate.number("gamma", gamma), validate.number("eta", eta)
    labels = labels.long()
    backend = select("cal_objective", logits.device)
    if backend == "reference":
        return reference.cal_objective(logits, labels, gamma, eta)
    return registry.kernels(backend).cal_objective_forward(logits.contiguous(), labels.contiguous(), gamma, eta)
