"""Bias-model debiasing objectives (docs/METHODS.md §4): product of experts, example reweighting, learned-mixin +H
and confidence regularisation, each a fixed bias model's per-example log-probabilities combined with the main model's
logits.

``loss, info = PoE(model)(batch)`` with ``batch["bias"]`` [B, C] (the bias model's log-probabilities of each example,
`cat_fast.bias`) besides the model's inputs and ``labels``; `ConfidenceRegularization` also takes
``batch["teacher_probs"]`` [B, C]. The model predicts with its own logits alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import models, ops
from ..ops.fused import upcast
from .base import Objective, check_number
from .config import BIAS, TEACHER, ObjectiveConfig, option

__all__ = ["BiasObjective", "PoE", "Reweight", "LearnedMixin", "ConfidenceRegularization", "LearnedMixinConfig"]


def _rows(name, value, like):
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"batch[{name!r}]: expected a float tensor [B, C] of log-probabilities, got "
                        f"{type(value).__name__ if not isinstance(value, torch.Tensor) else value.dtype}")
    if tuple(value.shape) != tuple(like.shape):
        raise ValueError(f"batch[{name!r}]: expected shape {tuple(like.shape)} (one row per example, one column per "
                         f"class of the model), got {tuple(value.shape)}")
    return value.to(like.device)


class BiasObjective(Objective):
    """Base of the bias-model losses: a member implements ``loss(logits, bias, labels, batch, cap)``.

    ``prune_last_layer=True``: the last layer runs for the first token only where `models.first_token_ready`
    accepts the model (the same logits; under dropout, draws for that token only); False: the model's full forward.
    ``training_layers``: the encoder layers run `layers.training` where it supports them."""

    requires = (BIAS,)
    uses_pooled = False  # the loss reads the pooled vector (learned-mixin's gate)

    def __init__(self, model, prune_last_layer=True, training_layers=True):
        super().__init__(model)
        model = self.model
        st = models.structure(model)
        if st.task != "sequence_classification":
            raise ValueError(f"{type(self).__name__} supports *ForSequenceClassification models, got {st.model_class}")
        self.prune_last_layer = bool(prune_last_layer)
        self.training_layers = bool(training_layers)

    @property
    def packs_rows(self) -> bool:
        """With the training layers (`Objective.packs_rows`)."""
        return self.training_layers

    def capture_key(self, batch, *args):
        """``()``: the loss is the model's forward and the bias model's log-probabilities in the batch, replayable as
        a CUDA graph (`cat_fast.step`)."""
        return ()

    def __call__(self, batch, pairs=None):
        self.step += 1
        labels = batch["labels"]
        if "bias" not in batch:
            raise ValueError(f"{type(self).__name__} needs batch['bias'] (the bias model's log-probabilities [B, C])")
        with torch.enable_grad():
            prune = self.prune_last_layer and models.first_token_ready(self.model, batch)
            cap = None
            if self.uses_pooled or not prune:  # the pooled vector for the gate, or the full last layer
                cap = models.capture(self.model, batch, None, pooled=True, rng=False, first_token=prune,
                                     training_layers=self.training_layers)
                logits = models.logits_of(cap.outputs)
            else:
                logits = models.logits_of(models.first_token_forward(self.model, batch,
                                                                     training_layers=self.training_layers))
            bias = _rows("bias", batch["bias"], logits)
            loss, info = self.loss(logits, bias, labels, batch, cap)
        with torch.no_grad():
            info = {"ce_loss": F.cross_entropy(upcast(logits.detach()), labels), **info}
        return loss, info

    def loss(self, logits, bias, labels, batch, cap):
        raise NotImplementedError


class PoE(BiasObjective):
    """Product of experts (Clark et al. 2019): ``CE(log_softmax(z) + b, y)``."""

    def loss(self, logits, bias, labels, batch, cap):
        loss = ops.poe_loss(logits, bias, labels)
        return loss, {"poe_loss": loss.detach()}


class Reweight(BiasObjective):
    """Example reweighting: ``w = 1 − p_b(y)`` (``weight="one_minus"``, Clark) or ``1 / p_b(y)`` (``"inverse"``, the
    mediation paper's released code); ``Σ w·CE / Σ w`` (``normalize="weights"``) or ``/ B`` (``"batch"``)."""

    def __init__(self, model, weight="one_minus", normalize="weights", **kwargs):
        super().__init__(model, **kwargs)
        if weight not in ("one_minus", "inverse"):
            raise ValueError(f"weight: expected 'one_minus' or 'inverse', got {weight!r}")
        if normalize not in ("weights", "batch"):
            raise ValueError(f"normalize: expected 'weights' or 'batch', got {normalize!r}")
        self.weight, self.normalize = weight, normalize

    def loss(self, logits, bias, labels, batch, cap):
        loss = ops.reweighted_loss(logits, bias, labels, normalize=self.normalize, weight=self.weight)
        return loss, {"reweight_loss": loss.detach()}


@dataclass
class LearnedMixinConfig(ObjectiveConfig):
    """Learned-mixin's option (`LearnedMixin.from_options`)."""

    title = "learned-mixin"
    entropy_weight: float = option(0.03, low=0.0, help="learned-mixin: weight of the entropy penalty")


class LearnedMixin(BiasObjective):
    """Learned-mixin +H (Clark et al. 2019): ``g = softplus(w·h + c)`` from the pooled vector h (a linear gate the
    objective owns: give `parameters()` to the optimizer), ``CE(log_softmax(z) + g·b, y) + entropy_weight ·
    H(softmax(g·b))``."""

    uses_pooled = True
    config = LearnedMixinConfig

    @classmethod
    def from_options(cls, model, options, **preset):
        """From the CLI: ``entropy_weight``."""
        if options.get("entropy_weight") is not None:
            preset.setdefault("entropy_weight", options["entropy_weight"])
        return cls(model, **preset)

    def __init__(self, model, entropy_weight=0.03, **kwargs):
        super().__init__(model, **kwargs)
        model = self.model
        self.entropy_weight = check_number("entropy_weight", entropy_weight, low=0)
        head = models.structure(model).head
        width = getattr(head, "in_features", None) or model.config.hidden_size
        param = next(model.parameters())
        self.gate = torch.nn.Linear(width, 1).to(device=param.device, dtype=param.dtype)

    def parameters(self):
        return list(self.gate.parameters())

    def state_dict(self):
        return {**super().state_dict(), "gate": self.gate.state_dict()}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        if "gate" in state:
            self.gate.load_state_dict(state["gate"])

    def loss(self, logits, bias, labels, batch, cap):
        pooled = cap.pooled
        self.gate.to(pooled.device)
        gate = self.gate(pooled.to(self.gate.weight.dtype)).squeeze(-1)
        loss = ops.learned_mixin_loss(logits, bias, labels, gate, entropy_weight=self.entropy_weight)
        return loss, {"learned_mixin_loss": loss.detach(), "gate_mean": F.softplus(gate.detach().float()).mean()}


class ConfidenceRegularization(BiasObjective):
    """Confidence regularisation (Utama et al. 2020): the teacher's probabilities scaled ``t̃ ∝ t^(1 − p_b(y))``,
    loss ``−Σ t̃ log softmax(z)``; ``batch["teacher_probs"]`` [B, C] from a trained teacher."""

    requires = (BIAS, TEACHER)

    def loss(self, logits, bias, labels, batch, cap):
        if "teacher_probs" not in batch:
            raise ValueError("ConfidenceRegularization needs batch['teacher_probs'] (a trained teacher's "
                             "probabilities [B, C])")
        teacher = _rows("teacher_probs", batch["teacher_probs"], logits)
        loss = ops.conf_reg_loss(logits, bias, labels, teacher)
        return loss, {"conf_reg_loss": loss.detach()}
