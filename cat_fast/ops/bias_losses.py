"""Bias-model losses (docs/METHODS.md §4) as functional ops: `poe_loss`, `reweight_loss`, `learned_mixin_loss`,
`confidence_regularization_loss`. `bias` is a fixed bias model's log-probabilities [B, C] (no gradient).

All four run on one fused kernel pair, `bias_loss_forward` / `bias_loss_backward` (docs/KERNELS.md "bias_loss"):
one launch per direction, the reduction inside the forward kernel.
"""
import torch

from ..kernels.reference import bias_losses as reference
from . import registry, validate
from .backend import select

__all__ = ["poe_loss", "reweight_loss", "learned_mixin_loss", "confidence_regularization_loss"]

registry.define({
    "bias_loss_forward": "(Tensor logits, Tensor bias, Tensor labels, Tensor aux, int kind, int reduction, "
                         "float entropy_weight, int ignore_index=-100) -> (Tensor, Tensor)",
    "bias_loss_backward": "(Tensor grad, Tensor logits, Tensor bias, Tensor labels, Tensor aux, Tensor denom, "
                          "int kind, int reduction, float entropy_weight, int ignore_index=-100) -> (Tensor, Tensor)",
}, triton="bias_loss")

REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}
POE, REWEIGHT, LEARNED_MIXIN, CONF_REG = 0, 1, 5, 6  # REWEIGHT + (weight == "inverse") + 2 * (normalize == "batch")
SCALARS = {"entropy_weight": dict(low=0.0), "ignore_index": validate.INT}


def _backward(family):
    def backward(ctx, grad_loss, _grad_denom):
        if grad_loss is None:
            return (None,) * 8
        logits, bias, labels, aux, denom = ctx.saved_tensors
        grad_logits, grad_aux = family.bias_loss_backward(
            grad_loss.contiguous(), logits, bias, labels, aux, denom, ctx.kind, ctx.reduction, ctx.entropy_weight,
            ctx.ignore_index)
        return grad_logits, None, None, (grad_aux if ctx.kind == LEARNED_MIXIN else None), None, None, None, None

    return backward


def _setup(ctx, inputs, output):
    logits, bias, labels, aux, ctx.kind, ctx.reduction, ctx.entropy_weight, ctx.ignore_index = inputs
    ctx.save_for_backward(logits, bias, labels, aux, output[1])
    ctx.set_materialize_grads(False)  # no zero-filled gradient for `denom`: one launch per backward


def _fake_forward(logits, bias, labels, aux, kind, reduction, entropy_weight, ignore_index=-100):
    acc = registry.acc_dtype(logits.dtype)
    shape = logits.shape[:1] if reduction == 0 else ()
    return logits.new_empty(shape, dtype=acc), logits.new_empty((), dtype=acc)


def _fake_backward(grad, logits, bias, labels, aux, denom, kind, reduction, entropy_weight, ignore_index=-100):
    acc = registry.acc_dtype(logits.dtype)
    return torch.empty_like(logits), logits.new_empty(logits.shape[:1] if kind == LEARNED_MIXIN else (0,), dtype=acc)


registry.register("bias_loss_forward", _fake_forward, _backward, _setup)
registry.register("bias_loss_backward", _fake_backward, registry.not_twice_differentiable("bias_loss"))


def _check(logits, bias, labels, ignore_index, name="bias"):
    (ignore_index,) = validate.scalars(SCALARS, ignore_index=ignore_index)
    validate.classes("logits", logits, labels, ignore_index)
    validate.tensor(name, bias, ndims=(2,))
    validate.shape(name, bias, logits.shape, "like logits: one row per example, one column per class")
    validate.same_device(logits=logits, **{name: bias})
    return labels.long(), ignore_index


def _fused(logits, bias, labels, aux, kind, reduction, entropy_weight, ignore_index):
    """The kernel's (loss, denom), or None where the reference composite runs."""
    backend = select("bias_loss", logits.device)
    if backend == "reference":
        return None
    acc = registry.acc_dtype(logits.dtype)
    if aux is None:
        aux = logits.new_empty((0,), dtype=acc)
    loss, _ = registry.kernels(backend).bias_loss_forward(
        logits.contiguous(), bias.detach().to(acc).contiguous(), labels.contiguous(), aux.to(acc).contiguous(),
        kind, REDUCTIONS[reduction], float(entropy_weight), ignore_index)
    return loss


def poe_loss(logits, bias, labels, reduction="mean", ignore_index=-100):
    """Product of experts: ``CE(log_softmax(logits) + bias, labels)``, reduced by mean / sum / none.

    logits [B, C] float; bias [B, C] the bias model's log-probabilities (no gradient); labels int [B] in [0, C) or
    `ignore_index` (such rows give 0, no gradient, and `mean` divides by the number of the others). The model
    predicts with `logits` alone."""
    labels, ignore_index = _check(logits, bias, labels, ignore_index)
    validate.choice("reduction", reduction, tuple(REDUCTIONS))
    loss = _fused(logits, bias, labels, None, POE, reduction, 0.0, ignore_index)
    return reference.poe_loss(logits, bias, labels, reduction, ignore_index) if loss is None else loss


def reweight_loss(logits, bias, labels, normalize="weights", weight="one_minus", ignore_index=-100):
    """``Σ w·CE / Σ w`` (``normalize="weights"``) or ``/ N`` (``"batch"``: the number of non-ignored rows),
    w = 1 − p_b(y) (``"one_minus"``, Clark et al.) or 1 / p_b(y) (``"inverse"``), p_b(y) = exp(bias[y])."""
    labels, ignore_index = _check(logits, bias, labels, ignore_index)
    validate.choice("normalize", normalize, ("weights", "batch"))
    validate.choice("weight", weight, ("one_minus", "inverse"))
    kind = REWEIGHT + (weight == "inverse") + 2 * (normalize == "batch")
    loss = _fused(logits, bias, labels, None, kind, "mean", 0.0, ignore_index)
    return reference.reweight_loss(logits, bias, labels, normalize, weight, ignore_index) if loss is None else loss


def learned_mixin_loss(logits, bias, labels, gate, entropy_weight=0.03, ignore_index=-100, reduction="mean"):
    """``CE(log_softmax(z) + g·b, y) + entropy_weight · H(softmax(g·b))``, g = softplus(gate) per row.

    gate [B] float (a learned map of the pooled vector: it gets a gradient; the bias does not); entropy_weight a
    finite number >= 0."""
    labels, ignore_index = _check(logits, bias, labels, ignore_index)
    validate.tensor("gate", gate, ndims=(1,))
    validate.size("gate", gate, 0, logits.shape[0], "one gate value per row")
    validate.same_device(logits=logits, gate=gate)
    (entropy_weight,) = validate.scalars(SCALARS, entropy_weight=entropy_weight)
    validate.choice("reduction", reduction, tuple(REDUCTIONS))
    loss = _fused(logits, bias, labels, gate, LEARNED_MIXIN, reduction, entropy_weight, ignore_index)
    if loss is None:
        return reference.learned_mixin_loss(logits, bias, labels, gate, entropy_weight, ignore_index, reduction)
    return loss


def confidence_regularization_loss(logits, teacher_probs, bias, labels, ignore_index=-100, reduction="mean"):
    """``−Σ t̃ log softmax(z)``, the teacher's probabilities scaled ``t̃ ∝ t^(1 − p_b(y))`` (Utama et al.).

    teacher_probs [B, C] (each row a distribution; no gradient)."""
    labels, ignore_index = _check(logits, bias, labels, ignore_index)
    validate.tensor("teacher_probs", teacher_probs, ndims=(2,))
    validate.shape("teacher_probs", teacher_probs, logits.shape, "like logits")
    validate.same_device(logits=logits, teacher_probs=teacher_probs)
    validate.choice("reduction", reduction, tuple(REDUCTIONS))
    loss = _fused(logits, bias, labels, teacher_probs.detach(), CONF_REG, reduction, 0.0, ignore_index)
    if loss is None:
        return reference.confidence_regularization_loss(logits, teacher_probs, bias, labels, ignore_index, reduction)
    return loss
