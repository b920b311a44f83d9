"""Bias-model losses (docs/METHODS.md §4) as functional ops: `poe_loss`, `reweight_loss`, `learned_mixin_loss`,
`confidence_regularization_loss`. `bias` is a fixed bias model's log-probabilities [B, C] (no gradient).

Arguments are checked here (errors name the argument); the computation is the composite of
`cat_fast.kernels.reference.bias_losses` on every device (fused kernels for these ops are not built yet).
"""
import math

import torch

from ..kernels.reference import bias_losses as reference
from . import validate

__all__ = ["poe_loss", "reweight_loss", "learned_mixin_loss", "confidence_regularization_loss"]


def _check(logits, bias, labels, name="bias"):
    validate.tensor("logits", logits, ndims=(2,))
    validate.nonempty_batch("logits", logits)
    validate.tensor(name, bias, ndims=(2,))
    validate.shape(name, bias, logits.shape, "like logits: one row per example, one column per class")
    validate.tensor("labels", labels, ndims=(1,), dtypes=(torch.int64, torch.int32))
    validate.same_device(logits=logits, **{name: bias}, labels=labels)
    validate.size("labels", labels, 0, logits.shape[0], "batch size of logits")
    return labels.long()


def poe_loss(logits, bias, labels, reduction="mean", ignore_index=-100):
    """Product of experts: ``CE(log_softmax(logits) + bias, labels)``, reduced by mean / sum / none."""
    labels = _check(logits, bias, labels)
    validate.choice("reduction", reduction, ("mean", "sum", "none"))
    return reference.poe_loss(logits, bias, labels, reduction, ignore_index)


def reweight_loss(logits, bias, labels, normalize="weights", weight="one_minus", ignore_index=-100):
    """``Σ w·CE / Σ w`` (``normalize="weights"``) or ``/ B`` (``"batch"``), w = 1 − p_b(y) (``"one_minus"``) or
    1 / p_b(y) (``"inverse"``)."""
    labels = _check(logits, bias, labels)
    validate.choice("normalize", normalize, ("weights", "batch"))
    validate.choice("weight", weight, ("one_minus", "inverse"))
    return reference.reweight_loss(logits, bias, labels, normalize, weight, ignore_index)


def learned_mixin_loss(logits, bias, labels, gate, entropy_weight=0.03, ignore_index=-100):
    """``CE(log_softmax(z) + g·b, y) + entropy_weight · H(softmax(g·b))``, g = softplus(gate), gate [B]."""
    labels = _check(logits, bias, labels)
    validate.tensor("gate", gate, ndims=(1,))
    validate.size("gate", gate, 0, logits.shape[0], "one gate value per row")
    entropy_weight = validate.number("entropy_weight", entropy_weight)
    if not math.isfinite(entropy_weight) or entropy_weight < 0:
        raise ValueError(f"entropy_weight: expected a finite number >= 0, got {entropy_weight}")
    return reference.learned_mixin_loss(logits, bias, labels, gate, entropy_weight, ignore_index)


def confidence_regularization_loss(logits, teacher_probs, bias, labels, ignore_index=-100):
    """``−Σ t̃ log softmax(z)`` (batch mean), the teacher's probabilities scaled ``t̃ ∝ t^(1 − p_b(y))``."""
    labels = _check(logits, bias, labels)
    validate.tensor("teacher_probs", teacher_probs, ndims=(2,))
    validate.shape("teacher_probs", teacher_probs, logits.shape, "like logits")
    return reference.confidence_regularization_loss(logits, teacher_probs, bias, labels, ignore_index)
