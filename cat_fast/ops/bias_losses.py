"""Bias-model losses (docs/METHODS.md §4) as functional ops, one function per loss: `poe_loss`, `reweighted_loss`,
`learned_mixin_loss` (+ `gate`, `entropy_weight`), `conf_reg_loss` (+ `teacher_probs`). `bias_log_probs` is a fixed
bias model's log-probabilities [B, C] (no gradient).

All four run on one fused kernel pair, `bias_loss_forward` / `bias_loss_backward` (docs/KERNELS.md "bias_loss"):
one launch per direction, the reduction inside the forward kernel. The kernels take the variant as their `kind`
launch parameter (`BiasLoss`, the same numbers as csrc/checks/bias_loss.h) and its extra tensor as `aux`; both are
formed in `_fused` only.
"""
import enum

import torch

from ..kernels.reference import bias_losses as reference
from . import registry, validate
from .backend import select

__all__ = ["poe_loss", "reweighted_loss", "learned_mixin_loss", "conf_reg_loss", "BiasLoss"]

registry.define({
    "bias_loss_forward": "(Tensor logits, Tensor bias, Tensor labels, Tensor aux, int kind, int reduction, "
                         "float entropy_weight, int ignore_index=-100) -> (Tensor, Tensor)",
    "bias_loss_backward": "(Tensor grad, Tensor logits, Tensor bias, Tensor labels, Tensor aux, Tensor denom, "
                          "int kind, int reduction, float entropy_weight, int ignore_index=-100) -> (Tensor, Tensor)",
}, triton="bias_loss")


class BiasLoss(enum.IntEnum):
    """The variants of the bias_loss kernels (their `kind`); `aux` is read by LEARNED_MIXIN and CONF_REG only."""

    POE = 0
    REWEIGHTED_ONE_MINUS = 1  # w = 1 − p_b(y), Σ w·CE / Σ w
    REWEIGHTED_INVERSE = 2  # w = 1 / p_b(y), Σ w·CE / Σ w
    REWEIGHTED_ONE_MINUS_BATCH = 3  # w = 1 − p_b(y), Σ w·CE / N
    REWEIGHTED_INVERSE_BATCH = 4  # w = 1 / p_b(y), Σ w·CE / N
    LEARNED_MIXIN = 5  # aux: the gate [B]
    CONF_REG = 6  # aux: the teacher's probabilities [B, C]


REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}
REWEIGHTED = {("weights", "one_minus"): BiasLoss.REWEIGHTED_ONE_MINUS,
              ("weights", "inverse"): BiasLoss.REWEIGHTED_INVERSE,
              ("batch", "one_minus"): BiasLoss.REWEIGHTED_ONE_MINUS_BATCH,
              ("batch", "inverse"): BiasLoss.REWEIGHTED_INVERSE_BATCH}
SCALARS = {"entropy_weight": dict(low=0.0), "ignore_index": validate.INT}


def _backward(family):
    def backward(ctx, grad_loss, _grad_denom):
        if grad_loss is None:
            return (None,) * 8
        logits, bias, labels, aux, denom = ctx.saved_tensors
        grad_logits, grad_aux = family.bias_loss_backward(
            grad_loss.contiguous(), logits, bias, labels, aux, denom, ctx.kind, ctx.reduction, ctx.entropy_weight,
            ctx.ignore_index)
        gate_grad = grad_aux if ctx.kind == BiasLoss.LEARNED_MIXIN else None
        return grad_logits, None, None, gate_grad, None, None, None, None

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
    rows = logits.shape[:1] if kind == BiasLoss.LEARNED_MIXIN else (0,)
    return torch.empty_like(logits), logits.new_empty(rows, dtype=acc)


registry.register("bias_loss_forward", _fake_forward, _backward, _setup)
registry.register("bias_loss_backward", _fake_backward, registry.not_twice_differentiable("bias_loss"))


def _check(logits, bias_log_probs, labels, ignore_index):
    (ignore_index,) = validate.scalars(SCALARS, ignore_index=ignore_index)
    validate.classes("logits", logits, labels, ignore_index)
    validate.tensor("bias_log_probs", bias_log_probs, ndims=(2,))
    validate.shape("bias_log_probs", bias_log_probs, logits.shape, "like logits: one row per example, one column per "
                   "class")
    validate.same_device(logits=logits, bias_log_probs=bias_log_probs)
    return labels.long(), ignore_index


def _fused(variant, logits, bias_log_probs, labels, reduction, ignore_index, gate=None, teacher_probs=None,
           entropy_weight=0.0):
    """The kernel's loss for `variant` (a `BiasLoss`), or None where the reference composite runs."""
    backend = select("bias_loss", logits.device)
    if backend == "reference":
        return None
    acc = registry.acc_dtype(logits.dtype)
    aux = {BiasLoss.LEARNED_MIXIN: gate, BiasLoss.CONF_REG: teacher_probs}.get(variant)
    aux = logits.new_empty((0,), dtype=acc) if aux is None else aux.to(acc).contiguous()
    loss, _ = registry.kernels(backend).bias_loss_forward(
        logits.contiguous(), bias_log_probs.detach().to(acc).contiguous(), labels.contiguous(), aux, int(variant),
        REDUCTIONS[reduction], float(entropy_weight), ignore_index)
    return loss


def poe_loss(logits, bias_log_probs, labels, reduction="mean", ignore_index=-100):
    """Product of experts: ``CE(log_softmax(logits) + bias_log_probs, labels)``, reduced by mean / sum / none.

    logits [B, C] float; bias_log_probs [B, C] the bias model's log-probabilities (no gradient); labels int [B] in
    [0, C) or `ignore_index` (such rows give 0, no gradient, and `mean` divides by the number of the others). The
    model predicts with `logits` alone."""
    labels, ignore_index = _check(logits, bias_log_probs, labels, ignore_index)
    validate.choice("reduction", reduction, tuple(REDUCTIONS))
    loss = _fused(BiasLoss.POE, logits, bias_log_probs, labels, reduction, ignore_index)
    return reference.poe_loss(logits, bias_log_probs, labels, reduction, ignore_index) if loss is None else loss


def reweighted_loss(logits, bias_log_probs, labels, normalize="weights", weight="one_minus", ignore_index=-100):
    """``Σ w·CE / Σ w`` (``normalize="weights"``) or ``/ N`` (``"batch"``: the number of non-ignored rows),
    w = 1 − p_b(y) (``"one_minus"``, Clark et al.) or 1 / p_b(y) (``"inverse"``), p_b(y) = exp(bias_log_probs[y])."""
    labels, ignore_index = _check(logits, bias_log_probs, labels, ignore_index)
    validate.choice("normalize", normalize, ("weights", "batch"))
    validate.choice("weight", weight, ("one_minus", "inverse"))
    loss = _fused(REWEIGHTED[normalize, weight], logits, bias_log_probs, labels, "mean", ignore_index)
    if loss is None:
        return reference.reweighted_loss(logits, bias_log_probs, labels, normalize, weight, ignore_index)
    return loss


def learned_mixin_loss(logits, bias_log_probs, labels, gate, entropy_weight=0.03, ignore_index=-100,
                       reduction="mean"):
    """``CE(log_softmax(z) + g·b, y) + entropy_weight · H(softmax(g·b))``, g = softplus(gate) per row,
    b = bias_log_probs.

    gate [B] float (a learned map of the pooled vector: it gets a gradient; the bias does not); entropy_weight a
    finite number >= 0."""
    labels, ignore_index = _check(logits, bias_log_probs, labels, ignore_index)
    validate.tensor("gate", gate, ndims=(1,))
    validate.size("gate", gate, 0, logits.shape[0], "one gate value per row")
    validate.same_device(logits=logits, gate=gate)
    (entropy_weight,) = validate.scalars(SCALARS, entropy_weight=entropy_weight)
    validate.choice("reduction", reduction, tuple(REDUCTIONS))
    loss = _fused(BiasLoss.LEARNED_MIXIN, logits, bias_log_probs, labels, reduction, ignore_index, gate=gate,
                  entropy_weight=entropy_weight)
    if loss is None:
        return reference.learned_mixin_loss(logits, bias_log_probs, labels, gate, entropy_weight, ignore_index,
                                            reduction)
    return loss


def conf_reg_loss(logits, bias_log_probs, labels, teacher_probs, ignore_index=-100, reduction="mean"):
    """Confidence regularisation: ``−Σ t̃ log softmax(z)``, the teacher's probabilities scaled
    ``t̃ ∝ t^(1 − p_b(y))`` (Utama et al.).

    teacher_probs [B, C] (each row a distribution; no gradient)."""
    labels, ignore_index = _check(logits, bias_log_probs, labels, ignore_index)
    validate.tensor("teacher_probs", teacher_probs, ndims=(2,))
    validate.shape("teacher_probs", teacher_probs, logits.shape, "like logits")
    validate.same_device(logits=logits, teacher_probs=teacher_probs)
    validate.choice("reduction", reduction, tuple(REDUCTIONS))
    loss = _fused(BiasLoss.CONF_REG, logits, bias_log_probs, labels, reduction, ignore_index,
                  teacher_probs=teacher_probs.detach())
    if loss is None:
        return reference.conf_reg_loss(logits, bias_log_probs, labels, teacher_probs, ignore_index, reduction)
    return loss
