"""Hugging Face `Trainer` integration: ``ObjectiveTrainer(..., objective="cat-star", objective_kwargs={...})`` for any
registered objective (`cat_fast.objectives`), and its two named forms ``CATTrainer(..., cat_kwargs={...})`` and
``GSTrainer(..., gs_kwargs={...})``.

They override ``compute_loss`` and use the objective only in training mode (evaluation uses the model's own loss),
so gradient accumulation, checkpoints and ``resume_from_checkpoint``, mixed precision and the logging integrations
are the Trainer's. What they add:

* Objectives that need pairs (GS) read them from the batch: ``pairs`` (the partner's index WITHIN the batch, -1 =
  none) or ``pair_group`` (a group id per example; partners = same id in the batch). With ``pair_group`` the
  training batches keep every group whole by default (``keep_groups``; `cat_fast.data.GroupBatchSampler`), and a
  warning says once when a logging window saw no usable pair (GS would then be plain ERM).
* ``info`` is averaged over the logging window and the accumulation steps, like ``loss``, and logged as
  ``<prefix>/<key>`` (one host transfer per logging step).
* ``objective.step`` is the optimizer step (warm-ups count in it); the objective's state (step, random generator)
  is saved in each checkpoint and restored on resume, so a resumed run draws what an uninterrupted one draws.
* A non-finite loss stops training with `NonFiniteLossError` naming the step and the term (``check_finite``; one
  host sync per step) before the optimizer applies it.
* The objective's loss is a per-batch mean: the Trainer divides it by the accumulation steps.
* Under torchrun the Trainer wraps the model in DistributedDataParallel; the objective then runs inside that DDP
  module's forward (`cat_fast.distributed.DistributedObjective`), so DDP averages the gradients of its loss once per
  step. Each rank's batches are its share of the batch stream (whole groups: accelerate deals out whole batches),
  its objective's generator is seeded with seed + rank, and each rank's objective state is saved in the checkpoint
  (``cat_fast_objective.pt`` for rank 0, ``cat_fast_objective.rank<R>.pt`` for the others).
* Compiled models are accepted: a model given compiled (``torch.compile(model)``, ``model.compile()``) and
  ``TrainingArguments(torch_compile=True)``, for which accelerate wraps the model (``torch.compile(model)``, or
  ``torch.compile(DDP(model))`` under torchrun) after the objective was built on it. The objective's passes run the
  original model uncompiled, so the training losses and gradients are exactly the uncompiled model's; its plain
  forwards (ERM; `Objective.plain_forward`) run the compiled wrapper when it wraps the model itself (not under
  torchrun, where the wrapper compiles DDP's forward, which the objective replaces); evaluation runs the compiled
  model, as the Trainer does.
* Refused with the reason: FSDP/DeepSpeed wrappers (the objective would bypass them); a model with compiled
  submodules only (accelerate's regional compilation: `cat_fast.models.structure`); the options an objective
  refuses under DDP (`Objective.check_distributed`).
* Mixed precision (``bf16=True`` / ``fp16=True``): the whole objective runs under accelerate's autocast, as in a
  plain loop under ``torch.autocast`` (accelerate itself autocasts only inside the model's forward, which left CAT's
  CAL loop and counterfactual passes, and GS's passes, in fp32).
* A double-backward failure of the attention kernel is re-raised as `cat_fast.objectives.DOUBLE_BACKWARD_HINT`.
"""
from __future__ import annotations

import os
import warnings

import torch
from transformers import Trainer
from transformers.modeling_utils import unwrap_model

from .. import objectives
from ..models import compiled_wrapper, orig_module
from ..objectives import double_backward_error, pair_by_group

__all__ = ["ObjectiveTrainer", "CATTrainer", "GSTrainer", "NonFiniteLossError", "OBJECTIVE_STATE"]

EXTRA_COLUMNS = ("pairs", "pair_group", "context_mask", "bias", "teacher_probs")
OBJECTIVE_STATE = "cat_fast_objective.pt"  # the objective's state inside a checkpoint folder


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite (the message names the step and the term)."""


class ObjectiveTrainer(Trainer):
    """`transformers.Trainer` that trains with a cat_fast objective (module docstring).

    ``objective``: a registered name (`cat_fast.objectives.names()`), an `Objective` subclass or an `Objective`
    built on this trainer's model; ``objective_kwargs``: the keyword arguments of the first two. ``keep_groups``:
    batches keep each ``pair_group`` whole (default: when the objective needs pairs and the dataset has that
    column). ``check_finite``: stop on a non-finite loss (default True)."""

    _log_prefix = "objective"

    def __init__(self, *args, objective=None, objective_kwargs=None, keep_groups=None, check_finite=True, **kwargs):
        super().__init__(*args, **kwargs)
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
        self.keep_groups = keep_groups
        self.check_finite = bool(check_finite)
        self._last_info = None
        self._info_sum = {}
        self._info_count = 0
        self._warned_no_pairs = False
        self._distributed = None  # the DistributedObjective, made on the first step under DDP
        self._objective_loaded = False  # a resumed run: each rank's generator comes from the checkpoint

    # ------------------------------------------------------------------ data
    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if self._signature_columns is not None:
            self._signature_columns = list(self._signature_columns) + [
                c for c in EXTRA_COLUMNS if c not in self._signature_columns
            ]

    def _group_ids(self):
        """The ``pair_group`` column when batches should keep groups whole, else None."""
        dataset = self.train_dataset
        names = getattr(dataset, "column_names", None) or []
        wanted = self.keep_groups
        if wanted is None:
            wanted = self.objective.needs_pairs and not getattr(self.objective, "random_pairs", False)
        if not wanted:
            return None
        if "pair_group" not in names:
            if self.keep_groups:
                raise ValueError("keep_groups=True needs a 'pair_group' column in train_dataset")
            return None
        return list(dataset["pair_group"])

    def get_train_dataloader(self):
        group_ids = self._group_ids()
        if group_ids is None:
            return super().get_train_dataloader()
        from ..data import GroupBatchSampler

        groups = {}
        for i, g in enumerate(group_ids):
            groups.setdefault(g, []).append(i)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        sampler = GroupBatchSampler(list(groups.values()), self._train_batch_size, shuffle=True, seed=seed)
        dataset, collator = self.train_dataset, self.data_collator
        try:
            import datasets

            is_hf = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf = False
        if is_hf:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collator,
                                             num_workers=self.args.dataloader_num_workers,
                                             pin_memory=self.args.dataloader_pin_memory)
        return self.accelerator.prepare(loader)

    # ------------------------------------------------------------------ steps
    def _eval_loss(self, model, inputs, return_outputs, num_items_in_batch, kwargs):
        plain = {k: v for k, v in inputs.items() if k not in EXTRA_COLUMNS}
        if num_items_in_batch is not None:
            kwargs = {**kwargs, "num_items_in_batch": num_items_in_batch}
        return super().compute_loss(model, plain, return_outputs=return_outputs, **kwargs)

    def training_step(self, *args, **kwargs):
        try:
            loss = super().training_step(*args, **kwargs)
        except RuntimeError as exc:
            mapped = double_backward_error(exc)
            if mapped is not None:
                raise mapped from exc
            raise
        if self.check_finite:
            finite = torch.isfinite(loss.detach()).all()
            everywhere = finite
            if torch.distributed.is_available() and torch.distributed.is_initialized() and (
                    torch.distributed.get_world_size() > 1):
                # every rank stops at the same step (DDP averaged the gradients of a non-finite loss into all of
                # them), not only the rank whose own loss is non-finite
                flag = finite.to(torch.float32).reshape(1)
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
                everywhere = flag[0] > 0
            if not bool(everywhere):
                if bool(finite):
                    raise NonFiniteLossError(f"the training loss became non-finite on another rank at step "
                                             f"{self.state.global_step + 1}; training stopped before the optimizer "
                                             "applied it")
                raise NonFiniteLossError(self._non_finite_message(loss))
        return loss

    def _non_finite_message(self, loss):
        step = self.state.global_step + 1
        terms = [k for k, v in (self._last_info or {}).items()
                 if isinstance(v, torch.Tensor) and not bool(torch.isfinite(v).all())]
        where = f"in {', '.join(terms)}" if terms else "in the objective's loss"
        return (f"the training loss became {float(loss.detach().float().mean())} at step {step} ({where}); "
                "training stopped before the optimizer applied it")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
        if not model.training:
            return self._eval_loss(model, inputs, return_outputs, num_items_in_batch, kwargs)
        objective = self.objective
        objective.step = self.state.global_step
        objective.set_optimizer(self.optimizer)
        call = objective
        inner = orig_module(model)  # torch_compile=True: the model or DDP module in accelerate's torch.compile wrapper
        if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
            if self._distributed is None or self._distributed.ddp is not inner:
                from ..distributed import DistributedObjective

                self._distributed = DistributedObjective(objective, inner, reseed=not self._objective_loaded)
            call = self._distributed
        elif unwrap_model(inner) is not inner:
            raise ValueError(f"{type(inner).__name__}: cat_fast's objectives run under DistributedDataParallel "
                             "(torchrun) only, not FSDP or DeepSpeed: the objective would bypass the wrapper")
        elif objective.compiled_model is None and inner is objective.model:
            objective.compiled_model = compiled_wrapper(model)  # the wrapper torch_compile=True made, if any
        if objective.needs_pairs:
            pairs = inputs.get("pairs")
            if pairs is None and "pair_group" in inputs:
                pairs = pair_by_group(inputs["pair_group"])
            if pairs is None and not getattr(objective, "random_pairs", False):
                raise ValueError(f"{type(self).__name__} needs a 'pairs' or 'pair_group' column in the batch "
                                 "(or random_pairs=True)")
            batch, args = {k: v for k, v in inputs.items() if k not in EXTRA_COLUMNS}, (pairs,)
        else:
            batch, args = inputs, ()
        with self.accelerator.autocast():
            loss, info = call(batch, *args)
        self._last_info = info
        for k, v in info.items():  # summed on the device: no host sync in the step
            v = v.detach().float() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
            self._info_sum[k] = v if k not in self._info_sum else self._info_sum[k] + v.to(self._info_sum[k].device)
        self._info_count += 1
        return (loss, None) if return_outputs else loss

    def log(self, logs, *args, **kwargs):
        if self._info_count and "loss" in logs:
            logs = dict(logs)
            means = {k: float(v) / self._info_count for k, v in self._info_sum.items()}
            logs.update({f"{self._log_prefix}/{k}": v for k, v in means.items()})
            self._info_sum, self._info_count = {}, 0
            if (self.objective.needs_pairs and not getattr(self.objective, "random_pairs", False)
                    and means.get("gs_pairs", 1.0) == 0 and not self._warned_no_pairs):
                self._warned_no_pairs = True
                warnings.warn(f"{type(self).__name__}: no training step since the last log saw a counterfactual "
                              "pair with another label in its batch, so the GS term is 0 (plain ERM): keep groups "
                              "in one batch (a 'pair_group' column; keep_groups=True) or check the pairs",
                              RuntimeWarning, stacklevel=2)
        return super().log(logs, *args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model, trial, *args, **kwargs):
        super()._save_checkpoint(model, trial, *args, **kwargs)
        folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        if self.args.should_save or self.args.process_index > 0:  # every rank its own state (generator, ...)
            os.makedirs(folder, exist_ok=True)
            torch.save(self.objective.state_dict(), os.path.join(folder, _objective_file(self.args.process_index)))

    def _load_from_checkpoint(self, resume_from_checkpoint, *args, **kwargs):
        super()._load_from_checkpoint(resume_from_checkpoint, *args, **kwargs)
        path = os.path.join(resume_from_checkpoint, _objective_file(self.args.process_index))
        if os.path.isfile(path):
            self.objective.load_state_dict(torch.load(path, weights_only=False))
            self._objective_loaded = True


def _objective_file(rank):
    return OBJECTIVE_STATE if rank == 0 else OBJECTIVE_STATE.replace(".pt", f".rank{rank}.pt")


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

