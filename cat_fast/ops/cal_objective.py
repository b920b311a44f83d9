"""cal_objective: the per-sample CAL objective gamma * CE + eta * max softmax (docs/METHODS.md §1.2)."""
import torch

from ..kernels import reference
from . import registry, validate
from .backend import select

registry.define({
    "cal_objective_forward": "(Tensor logits, Tensor labels, float gamma, float eta, int ignore_index=-100) -> Tensor",
    "cal_objective_backward": "(Tensor grad, Tensor logits, Tensor labels, float gamma, float eta, "
                              "int ignore_index=-100) -> Tensor",
}, triton="cal_objective")

REDUCTIONS = ("none", "mean", "sum")
SCALARS = {"gamma": {}, "eta": {}, "ignore_index": validate.INT}  # the weights: any finite numbers


def _forward_backward(family):
    def backward(ctx, grad):
        logits, labels = ctx.saved_tensors
        grad_logits = family.cal_objective_backward(grad.contiguous(), logits, labels, ctx.gamma, ctx.eta,
                                                    ctx.ignore_index)
        return grad_logits, None, None, None, None

    return backward


def _setup(ctx, inputs, output):
    logits, labels, ctx.gamma, ctx.eta, ctx.ignore_index = inputs
    ctx.save_for_backward(logits, labels)


registry.register(
    "cal_objective_forward",
    lambda logits, labels, gamma, eta, ignore_index=-100: logits.new_empty(
        logits.shape[:1], dtype=registry.acc_dtype(logits.dtype)),
    _forward_backward,
    _setup,
)
registry.register(
    "cal_objective_backward",
    lambda grad, logits, labels, gamma, eta, ignore_index=-100: torch.empty_like(logits),
    registry.not_twice_differentiable("cal_objective"),
)


def cal_objective(logits, labels, gamma=10.0, eta=20.0, reduction="none", ignore_index=-100):
    """CAL objective `gamma * CE(logits_i, y_i) + eta * Phi(logits_i)`, Phi = max_c softmax(logits_i)_c.

    logits [B, C] float; labels int64/int32 [B], values in [0, C) or `ignore_index`. Defaults: the CAT paper's
    gamma = 10, eta = 20 (any finite numbers). Rows whose label equals `ignore_index` give 0 and a zero gradient. reduction: "none"
    (the [B] per-sample objectives, float32, or float64 for float64 logits), "sum", or "mean" — the sum divided by
    the number of non-ignored rows, NaN when every row is ignored (like `F.cross_entropy`). The reductions run on the
    [B] output of the one kernel. Phi's subgradient at tied maxima goes to the FIRST tied index (`torch.argmax`'s
    choice), on every backend.
    """
    validate.choice("reduction", reduction, REDUCTIONS)
    gamma, eta, ignore_index = validate.scalars(SCALARS, gamma=gamma, eta=eta, ignore_index=ignore_index)
    validate.classes("logits", logits, labels, ignore_index)
    labels = labels.long()
    backend = select("cal_objective", logits.device)
    if backend == "reference":
        out = reference.cal_objective(logits, labels, gamma, eta, ignore_index)
    else:
        out = registry.kernels(backend).cal_objective_forward(
            logits.contiguous(), labels.contiguous(), gamma, eta, ignore_index)
    if reduction == "sum":
        return out.sum()
    if reduction == "mean":
        return out.sum() / (labels != ignore_index).sum()
    return out
