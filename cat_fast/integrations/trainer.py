"""Hugging Face `Trainer` integration: ``ObjectiveTrainer(..., objective="cat-star", objective_kwargs={...})`` for any
registered objective (`cat_fast.objectives`), and its two named forms ``CATTrainer(..., cat_kwargs={...})`` and
``GSTrainer(..., gs_kwargs={...})``.

They override ``compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs)`` (the
signature of transformers 4.46 … 5.x) and use the objective only in training mode; evaluation / prediction use
the model's own loss (ERM) on the model inputs. Choices:

* The objective wraps ``trainer.model`` (the unwrapped model): single-process training (CPU, one GPU). Under
  DDP/FSDP/DeepSpeed the objective would bypass the wrapper; that is not supported.
* The objective's loss is a per-batch mean: the trainers tell the Trainer to divide it by the gradient-accumulation
  steps (``loss_is_scaled_for_ga = False`` and ``model_accepts_loss_kwargs = False``, for old and new versions).
* Warm-ups count optimizer steps: ``objective.step`` is set to ``state.global_step`` before each call.
  CAT's ``update="alternate"`` uses the Trainer's optimizer for the CRM update unless ``cat_kwargs["crm_optimizer"]``
  is given (that inner step bypasses the Trainer's gradient clipping and AMP scaling).
* Objectives that need pairs (GS) read them from the batch: ``pairs`` (int64, index of the partner WITHIN the batch, -1 = none) or
  ``pair_group`` (a group id per example; partners = same id in the batch, via `cat_fast.objectives.pair_by_group`). These
  columns (and ``context_mask`` for QA CAT) are kept by ``remove_unused_columns``. Note that the default shuffled
  sampler rarely puts both members of a pair in one batch: build batches that keep groups together (e.g. a
  dataset of pre-grouped rows with ``shuffle`` handled upstream) or use ``random_pairs=True``.
* The last step's ``info`` is added to the Trainer's logs as ``cat/<key>`` / ``gs/<key>`` floats (one host
  transfer per logging step, outside the training step).
* A double-backward failure of the attention kernel in ``backward`` is re-raised as the one-line fix message
  of `cat_fast.objectives.DOUBLE_BACKWARD_HINT`.
"""
from __future__ import annotations

from transformers import Trainer

from .. import objectives
from ..objectives import double_backward_error, pair_by_group

__all__ = ["ObjectiveTrainer", "CATTrainer", "GSTrainer"]

EXTRA_COLUMNS = ("pairs", "pair_group", "context_mask")


class ObjectiveTrainer(Trainer):
    """`transformers.Trainer` that trains with a cat_fast objective: ``objective`` is a registered name
    (`cat_fast.objectives.names()`), an `Objective` subclass or an `Objective` built on this trainer's model;
    ``objective_kwargs`` are the keyword arguments of the first two."""

    _log_prefix = "objective"

    def __init__(self, *args, objective=None, objective_kwargs=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._last_info = None
        self.loss_is_scaled_for_ga = False
        self.model_accepts_loss_kwargs = False
        if objective is None:
            raise ValueError(f"objective: expected a registered name ({', '.join(objectives.names())}) or an "
                             "Objective, got None")
        if isinstance(objective, str):
            objective = objectives.build(objective, self.model, **(objective_kwargs or {}))
        elif isinstance(objective, type) and issubclass(objective, objectives.Objective):
            objective = objective(self.model, **(objective_kwargs or {}))
        elif not isinstance(objective, objectives.Objective):
            raise TypeError(f"objective: expected a registered name or an Objective, got {type(objective).__name__}")
        self.objective = objective

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if self._signature_columns is not None:
            self._signature_columns = list(self._signature_columns) + [
                c for c in EXTRA_COLUMNS if c not in self._signature_columns
            ]

    def _eval_loss(self, model, inputs, return_outputs, num_items_in_batch, kwargs):
        plain = {k: v for k, v in inputs.items() if k not in EXTRA_COLUMNS}
        if num_items_in_batch is not None:
            kwargs = {**kwargs, "num_items_in_batch": num_items_in_batch}
        return super().compute_loss(model, plain, return_outputs=return_outputs, **kwargs)

    def training_step(self, *args, **kwargs):
        try:
            return super().training_step(*args, **kwargs)
        except RuntimeError as exc:
            mapped = double_backward_error(exc)
            if mapped is not None:
                raise mapped from exc
            raise

    def log(self, logs, *args, **kwargs):
        if self._last_info is not None and "loss" in logs:
            logs = dict(logs)
            logs.update({f"{self._log_prefix}/{k}": float(v) for k, v in self._last_info.items()})
            self._last_info = None
        return super().log(logs, *args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
        if not model.training:
            return self._eval_loss(model, inputs, return_outputs, num_items_in_batch, kwargs)
        objective = self.objective
        objective.step = self.state.global_step
        objective.set_optimizer(self.optimizer)
        if objective.needs_pairs:
            pairs = inputs.get("pairs")
            if pairs is None and "pair_group" in inputs:
                pairs = pair_by_group(inputs["pair_group"])
            if pairs is None and not getattr(objective, "random_pairs", False):
                raise ValueError(f"{type(self).__name__} needs a 'pairs' or 'pair_group' column in the batch "
                                 "(or random_pairs=True)")
            batch = {k: v for k, v in inputs.items() if k not in EXTRA_COLUMNS}
            loss, info = objective(batch, pairs)
        else:
            loss, info = objective(inputs)
        self._last_info = info
        return (loss, None) if return_outputs else loss


class CATTrainer(ObjectiveTrainer):
    """`transformers.Trainer` that trains with `cat_fast.CAT`; ``cat_kwargs`` are CAT's keyword arguments."""

    _log_prefix = "cat"

    def __init__(self, *args, cat_kwargs=None, **kwargs):
        super().__init__(*args, objective=objectives.CAT, objective_kwargs=cat_kwargs, **kwargs)

    @property
    def cat(self):
        return self.objective


class GSTrainer(ObjectiveTrainer):
    """`transformers.Trainer` that trains with `cat_fast.GradientSupervision`; ``gs_kwargs`` are its keyword
    arguments."""

    _log_prefix = "gs"

    def __init__(self, *args, gs_kwargs=None, **kwargs):
        super().__init__(*args, objective=objectives.GradientSupervision, objective_kwargs=gs_kwargs, **kwargs)

    @property
    def gs(self):
        return self.objective
