"""ERM: the model's own loss (cross-entropy for sequence classifiers), as an objective; and the equal-update
control of CAT's alternating update (`ERM(model, extra_optimizer=...)`, ``erm-two-step``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import models
from ..models.inputs import MODEL_TARGETS, TARGET_KEYS
from ..ops.fused import upcast
from ..step import NotCapturable
from .base import Objective, check_number, check_single_label
from .config import ObjectiveConfig, option

__all__ = ["ERM", "ERMConfig"]


@dataclass
class ERMConfig(ObjectiveConfig):
    """ERM's option: the extra step's learning rate of ``erm-two-step`` (`ERM.from_options`)."""

    title = "erm-two-step"
    crm_lr: float = option(2e-5, low=0.0, help="learning rate of the CRM step with --cat-update alternate (and of "
                           "erm-two-step's extra step)")


class ERM(Objective):
    """``loss, info = ERM(model)(batch)``: ``model(**batch).loss`` (labels in the batch); ``info`` is empty. A
    compiled model runs compiled (`Objective.plain_forward`). ``fast=True`` (single-label classifiers): the same
    loss and gradients through `models.first_token_forward` with the training layers (the last layer for the first
    token only, each other layer one autograd node): less GPU and host work per step. Under dropout the cut last
    layer draws masks for the first token only, so the draws differ from the model's full forward (the same
    distribution, not the same numbers).

    ``extra_optimizer`` (the ``erm-two-step`` control): before the loss that the caller steps on, one more ERM step
    on the same batch with this optimizer (its own gradients; the caller's ``.grad`` left as it was), then the loss
    of the updated model is returned — two optimizer updates per batch, as `CAT`'s alternating update makes (a CRM
    step on its own AdamW, then ERM on the updated model), with the counterfactual loss replaced by the plain one.
    Like CAT, the extra step starts after ``warmup_steps`` calls."""

    config = ERMConfig

    def __init__(self, model, extra_optimizer=None, warmup_steps: int = 0, two_step: bool = False,
                 extra_lr: float = 2e-5, fast: bool = False):
        super().__init__(model)
        model = self.model
        if not isinstance(fast, bool):
            raise TypeError(f"fast: expected True or False, got {fast!r}")
        if fast and (extra_optimizer is not None or two_step):
            raise ValueError("fast=True is the plain step; it does not combine with extra_optimizer / two_step")
        if fast:
            check_single_label(getattr(model, "config", None), "ERM(fast=True)")
        self.fast = fast
        extra_lr = check_number("extra_lr", extra_lr, low=0.0, low_open=True)
        if two_step and extra_optimizer is None:  # CAT's alternate: AdamW (its defaults) at lr 2e-5
            extra_optimizer = torch.optim.AdamW(model.parameters(), lr=extra_lr)
        self.extra_optimizer = extra_optimizer
        self.warmup_steps = check_number("warmup_steps", warmup_steps, low=0, integer=True)

    @classmethod
    def from_options(cls, model, options, **preset):
        """From the CLI: ``crm_lr`` is the extra step's learning rate (as for CAT's alternating update)."""
        if preset.get("two_step") and options.get("crm_lr") is not None:
            preset.setdefault("extra_lr", options["crm_lr"])
        return cls(model, **preset)

    def capture_key(self, batch, *args):
        """``()``: the step is the model's forward and loss, replayable as a CUDA graph (`cat_fast.step`); not with
        ``extra_optimizer`` (an inner optimizer step) or a compiled model (compile with mode="reduce-overhead"
        instead)."""
        if self.extra_optimizer is not None:
            raise NotCapturable("ERM with extra_optimizer (erm-two-step) makes an inner optimizer step inside its call, "
                                "which CapturedStep does not capture yet")
        if self.compiled_model is not None:
            raise NotCapturable("ERM on a torch.compile'd model: use torch.compile(..., mode='reduce-overhead'), "
                                "which captures CUDA graphs itself")
        return ()

    def __call__(self, batch, pairs=None):
        self.step += 1
        # the model's own targets stay (its loss reads them); every other declared column is cat_fast data
        inputs = {k: v for k, v in batch.items() if k in MODEL_TARGETS or k not in TARGET_KEYS}
        if self.extra_optimizer is not None and self.step > self.warmup_steps:
            with torch.enable_grad():
                first = self.plain_forward(inputs).loss
                self.inner_update(first, self.extra_optimizer)
            loss = self.plain_forward(inputs).loss
            return loss, {"extra_step_loss": first.detach()}
        if self.fast:
            return self._fast_loss(inputs), {}
        return self.plain_forward(inputs).loss, {}

    @property
    def packs_rows(self) -> bool:
        """``fast=True`` without an extra optimizer: its forward is `models.first_token_forward` with the training
        layers (`Objective.packs_rows`)."""
        return bool(self.fast) and self.extra_optimizer is None

    def _fast_loss(self, inputs):
        """``fast=True``: the cross-entropy of `models.first_token_forward` with the training layers (the model's
        logits and gradients with the last layer for row 0 only and each other layer one autograd node), for
        single-label sequence classifiers, whose own loss it equals."""
        labels = inputs.get("labels")
        if labels is None or labels.is_floating_point() or labels.dim() != 1:
            raise ValueError("ERM(fast=True): expected integer labels of shape [B] in the batch; got "
                             f"{None if labels is None else (tuple(labels.shape), labels.dtype)}")
        outputs = models.first_token_forward(self.model, inputs, training_layers=True)
        return F.cross_entropy(upcast(models.logits_of(outputs)), labels)
