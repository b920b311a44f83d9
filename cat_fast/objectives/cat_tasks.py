"""CAT's task handling in one place: what a ``*ForSequenceClassification`` and a ``*ForQuestionAnswering`` model
differ in — the targets, ERM, CRM and its weights, the CAL objective, and which positions CMIX may mix (QA: the
non-answer context only, docs/METHODS.md §1.5). `task_for` picks one from `models.structure`'s task.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import models
from ..ops import cal_objective, crm_loss, crm_weights
from ..ops.fused import upcast

__all__ = ["Classification", "QuestionAnswering", "task_for"]


class Classification:
    """A single-label classifier: targets ``labels`` [B], logits [B, C]. Its head reads the first token only (the
    last layer may be pruned), and its targets are known before the forward (the CAL graphs may replay early)."""

    qa = False
    first_token_head = True
    targets_before_forward = True  # ``labels``, and no mixing mask: the CAL graphs replay as soon as h_m exists

    def targets(self, batch, outputs):
        return batch["labels"], models.logits_of(outputs)

    def erm(self, logits, targets):
        return F.cross_entropy(upcast(logits), targets)

    def crm(self, logits, cf_logits, targets, **kw):
        return crm_loss(logits, cf_logits, targets, **kw)

    def weights(self, logits, cf_logits, a1, a2):
        return crm_weights(logits, cf_logits, a1, a2).mean()

    def cal_objective(self, cf_logits, targets, gamma, eta):
        return cal_objective(cf_logits, targets, gamma, eta)

    def allow(self, config, batch, targets, T, device):
        """None: every position is mixed."""
        return None


class QuestionAnswering:
    """An extractive QA model: targets (start, end) positions clamped to the sequence, logits (start, end) [B, T];
    every loss is the sum over the two heads (the CRM weight their mean)."""

    qa = True
    first_token_head = False
    targets_before_forward = False  # clamped to the logits' length, and the mixing mask depends on them

    def targets(self, batch, outputs):
        logits = models.logits_of(outputs)
        T = logits[0].shape[1]
        s = batch["start_positions"].clamp(0, T - 1)
        e = batch["end_positions"].clamp(0, T - 1)
        return (s, e), logits

    def erm(self, logits, targets):
        return F.cross_entropy(upcast(logits[0]), targets[0]) + F.cross_entropy(upcast(logits[1]), targets[1])

    def crm(self, logits, cf_logits, targets, **kw):
        return sum(crm_loss(z, zc, y, **kw) for z, zc, y in zip(logits, cf_logits, targets))

    def weights(self, logits, cf_logits, a1, a2):
        return sum(crm_weights(z, zc, a1, a2).mean() for z, zc in zip(logits, cf_logits)) / 2

    def cal_objective(self, cf_logits, targets, gamma, eta):
        return sum(cal_objective(z, y, gamma, eta) for z, y in zip(cf_logits, targets))

    def allow(self, config, batch, targets, T, device):
        """[B, T] float32: 1 where CMIX may mix — context tokens (``context_mask``, else ``token_type_ids`` == 1,
        else the tokens after the first separator) outside the answer span and the padding."""
        cfg = config
        attn = batch.get("attention_mask")
        if "context_mask" in batch:
            context = batch["context_mask"].to(device).bool()
        elif "token_type_ids" in batch and getattr(cfg, "type_vocab_size", 1) > 1:
            context = batch["token_type_ids"] == 1
        else:
            sep = getattr(cfg, "sep_token_id", None)
            sep = getattr(cfg, "eos_token_id", None) if sep is None else sep
            if sep is None or "input_ids" not in batch:
                raise ValueError("CAT for QA cannot find the context: pass batch['context_mask'] (1 on context "
                                 "tokens), token_type_ids, or set config.sep_token_id")
            is_sep = batch["input_ids"] == sep
            context = (is_sep.cumsum(1) > 0) & ~is_sep
        pos = torch.arange(T, device=device)
        s, e = targets
        answer = (pos >= s.unsqueeze(1)) & (pos <= e.unsqueeze(1))
        allow = context & ~answer
        if attn is not None:
            allow = allow & (attn != 0)
        return allow.to(torch.float32)


def task_for(structure):
    """The task handling of a model of this `models.structure` (question answering or sequence classification)."""
    return QuestionAnswering() if structure.task == "question_answering" else Classification()
