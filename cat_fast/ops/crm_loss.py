"""crm_loss: counterfactual risk, the clipped importance-weighted cross-entropy (docs/METHODS.md §1.3)."""
import torch

from ..kernels import reference
from . import registry, validate
from .backend import select

registry.define({
    "crm_loss_forward": "(Tensor logits, Tensor cf_logits, Tensor labels, float a1, float a2, int reduction, "
                        "bool detach_weight, int ignore_index=-100) -> (Tensor, Tensor)",
    "crm_loss_backward": "(Tensor grad, Tensor logits, Tensor cf_logits, Tensor labels, Tensor stats, float a1, "
                         "float a2, int reduction, bool detach_weight, int ignore_index=-100) -> (Tensor, Tensor)",
}, triton="crm_loss")

REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}
# a1 <= a2: the weight's clip range, an infinite end is no clip there
SCALARS = {"a1": dict(finite=False), "a2": dict(finite=False), "ignore_index": validate.INT}


def _forward_backward(family):
    def backward(ctx, grad_loss, _grad_stats):
        if grad_loss is None:
            return (None,) * 8
        logits, cf_logits, labels, stats = ctx.saved_tensors
        grad_logits, grad_cf = family.crm_loss_backward(
            grad_loss.contiguous(), logits, cf_logits, labels, stats, ctx.a1, ctx.a2, ctx.reduction, ctx.detach_weight,
            ctx.ignore_index,
        )
        return grad_logits, (None if ctx.detach_weight else grad_cf), None, None, None, None, None, None

    return backward


def _setup(ctx, inputs, output):
    logits, cf_logits, labels, ctx.a1, ctx.a2, ctx.reduction, ctx.detach_weight, ctx.ignore_index = inputs
    ctx.save_for_backward(logits, cf_logits, labels, output[1])
    ctx.set_materialize_grads(False)  # no zero-filled gradient for the unused `stats` output: one launch per backward


def _fake_forward(logits, cf_logits, labels, a1, a2, reduction, detach_weight, ignore_index=-100):
    acc = registry.acc_dtype(logits.dtype)
    shape = logits.shape[:1] if reduction == 0 else ()
    return logits.new_empty(shape, dtype=acc), logits.new_empty((logits.shape[0], 4), dtype=acc)


registry.register("crm_loss_forward", _fake_forward, _forward_backward, _setup)
registry.register(
    "crm_loss_backward",
    lambda grad, logits, cf_logits, labels, stats, a1, a2, reduction, detach_weight, ignore_index=-100: (
        torch.empty_like(logits),
        torch.empty_like(cf_logits),
    ),
    registry.not_twice_differentiable("crm_loss"),
)


def _validate_pair(logits, cf_logits, a1, a2):
    validate.tensor("logits", logits, ndims=(2,))
    validate.nonempty_batch("logits", logits)
    validate.tensor("cf_logits", cf_logits, ndims=(2,))
    validate.shape("cf_logits", cf_logits, logits.shape, "like logits")
    if cf_logits.dtype != logits.dtype:
        raise TypeError(f"cf_logits: expected dtype {logits.dtype} (the dtype of logits), got {cf_logits.dtype}")
    validate.same_device(logits=logits, cf_logits=cf_logits)
    a1, a2 = validate.scalars(SCALARS, a1=a1, a2=a2)
    if a1 > a2:
        raise ValueError(f"a1, a2: expected a1 <= a2 (clip range of the weight), got a1={a1} > a2={a2}")
    return a1, a2


def crm_weights(logits, cf_logits, a1=0.0, a2=10.0):
    """The clipped importance weights `clip(max softmax(logits_i) / max softmax(cf_logits_i), a1, a2)`: [B], no gradient.

    a1, a2: numbers, +-inf allowed, NaN not (ValueError)."""
    a1, a2 = _validate_pair(logits, cf_logits, a1, a2)
    backend = select("crm_loss", logits.device)
    with torch.no_grad():
        if backend == "reference":
            return reference.crm_weights(logits, cf_logits, a1, a2)
        labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)  # the kernel's CE column is unused
        _, stats = registry.kernels(backend).crm_loss_forward(
            logits.contiguous(), cf_logits.contiguous(), labels, a1, a2, 0, True
        )
        return stats[:, 0]


def crm_loss(logits, cf_logits, labels, a1=0.0, a2=10.0, detach_weight=True, reduction="mean", ignore_index=-100):
    """`clip(Phi(logits_i) / Phi(cf_logits_i), a1, a2) * CE(logits_i, y_i)`, reduced by `mean`, `sum` or `none`.

    Phi = the highest class probability. a1 <= a2: numbers, +-inf allowed, NaN not (ValueError). With
    detach_weight=False the weight's gradient flows into both logits (zero where the ratio is clipped); Phi's
    subgradient at tied maxima goes to the FIRST tied index (`torch.argmax`'s choice), on every backend.
    Rows whose label equals `ignore_index` give loss 0 and zero gradients, and `mean` divides by the number of
    the other rows: NaN when every row is ignored (like `F.cross_entropy`).
    """
    (ignore_index,) = validate.scalars(SCALARS, ignore_index=ignore_index)
    validate.classes("logits", logits, labels, ignore_index)
    a1, a2 = _validate_pair(logits, cf_logits, a1, a2)
    validate.choice("reduction", reduction, tuple(REDUCTIONS))
    if not isinstance(detach_weight, bool):
        raise TypeError(f"detach_weight: expected a bool, got {type(detach_weight).__name__}")
    labels = labels.long()
    backend = select("crm_loss", logits.device)
    if backend == "reference":
        return reference.crm_loss(logits, cf_logits, labels, a1, a2, detach_weight, reduction, ignore_index)
    if detach_weight:
        cf_logits = cf_logits.detach()
    loss, _ = registry.kernels(backend).crm_loss_forward(
        logits.contiguous(), cf_logits.contiguous(), labels.contiguous(), a1, a2, REDUCTIONS[reduction], detach_weight,
        ignore_index,
    )
    return loss
