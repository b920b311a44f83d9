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
* A non-finite loss stops training with `NonFiniteLossError` naming the step and the term (``check_finite``) before
  the optimizer applies it: the eager step reads it at once (one host sync per step); the captured step's is copied
  to the host behind it and read at the next step, the fused optimizer having skipped the step on the device, so
  training stops then, before a checkpoint, or when `train` returns (`step_graphs.ASYNC`: the captured steps make
  no host sync).
* The objective's loss is a per-batch mean: the Trainer divides it by the accumulation steps.
* Several GPUs visible outside torchrun: the Trainer would wrap the model in DataParallel, which the objectives
  would bypass; training runs on one GPU instead (``args`` set to one, the batch size per device kept), with one
  `SingleGPUWarning` naming the torchrun command that trains on all of them.
* Under torchrun the Trainer wraps the model in DistributedDataParallel; the objective then runs inside that DDP
  module's forward (`cat_fast.distributed.DistributedObjective`), so DDP averages the gradients of its loss once per
  step. Each rank's batches are its share of the batch stream (whole groups: accelerate deals out whole batches),
  its objective's generator is seeded with seed + rank, and each rank's objective state is saved in the checkpoint
  (``cat_fast_objective.pt`` for rank 0, ``cat_fast_objective.rank<R>.pt`` for the others).
* Checkpoints are written atomically (`cat_fast.integrations.checkpoints`): staged in a hidden folder, sealed by a
  manifest, renamed into place, and only then are older ones rotated away (``save_total_limit``); a resume
  (``resume_from_checkpoint=True``) takes the newest complete checkpoint, and the objective's state is read with
  ``torch.load(..., weights_only=True)``.
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
* ``step_graphs``: each training step, the objective's loss, backward, gradient clipping and the optimizer's step,
  is one `cat_fast.step.CapturedStep` (one CUDA graph per batch signature on a GPU; the same step run eagerly
  elsewhere), and the Trainer's own backward, clipping and optimizer step are skipped. Under torchrun the step runs
  outside DDP's forward and averages the gradients itself (`cat_fast.step_ddp`: on GPUs the all-reduce is part of
  the captured graph, and the ranks capture and replay in lockstep); when `train` returns, the captured step is
  dropped (graphs holding NCCL collectives must go before the process group). It needs no
  gradient accumulation, bf16 or fp32, and a fused AdamW (the trainer makes one, with a tensor learning rate that the
  scheduler updates in place, capturable on a GPU; a given optimizer must be so). ``None`` (the default): on where
  the run allows it on a GPU; elsewhere, and from the first step an objective cannot replay (CAT's alternating
  update, ``erm-two-step``; refused before any state changed), the eager step runs with one `StepGraphsWarning`
  saying why (none on the CPU). ``True``: required (`StepGraphsError` with the reason); ``False``: off. A non-finite
  loss or gradient norm leaves the parameters as they were (the fused step skips it on the device) and stops
  training with `NonFiniteLossError`. The gradient norm before clipping is logged as ``<prefix>/grad_norm`` (the
  Trainer's own ``grad_norm`` finds the gradients already released and logs 0).
"""
from __future__ import annotations

import warnings

import torch
from transformers import Trainer
from transformers.modeling_utils import unwrap_model

from .. import objectives
from ..distributed import world
from ..models import compiled_wrapper, orig_module
from ..objectives import double_backward_error
from .step_graphs import (
    NOT_ON_A_GPU,
    NonFiniteLossError,
    StepGraphs,
    StepGraphsError,
    StepGraphsWarning,
    eager_warning,
)
from .trainer_checkpoints import OBJECTIVE_STATE, TrainerCheckpoints

__all__ = ["ObjectiveTrainer", "CATTrainer", "GSTrainer", "NonFiniteLossError", "SingleGPUWarning", "StepGraphsError",
           "StepGraphsWarning", "OBJECTIVE_STATE"]



class SingleGPUWarning(UserWarning):
    """`ObjectiveTrainer` trains on one of the several GPUs visible outside torchrun (``gpus``: how many)."""

    def __init__(self, gpus: int):
        super().__init__(f"ObjectiveTrainer: {gpus} GPUs are visible outside torchrun; training runs on one "
                         f"(cat_fast's objectives do not run under DataParallel): torchrun --nproc_per_node {gpus} ... "
                         "trains on all of them")
        self.gpus = gpus


class ObjectiveTrainer(StepGraphs, TrainerCheckpoints, Trainer):
    """`transformers.Trainer` that trains with a cat_fast objective (module docstring).

    ``objective``: a registered name (`cat_fast.objectives.names()`), an `Objective` subclass or an `Objective`
    built on this trainer's model; ``objective_kwargs``: the keyword arguments of the first two. ``keep_groups``:
    batches keep each ``pair_group`` whole (default: when the objective needs pairs and the dataset has that
    column). ``check_finite``: stop on a non-finite loss (default True)."""

    _log_prefix = "objective"

    def __init__(self, *args, objective=None, objective_kwargs=None, keep_groups=None, check_finite=True,
                 step_graphs=None, **kwargs):
        self.step_graphs = step_graphs if step_graphs is None else bool(step_graphs)
        self._graphs_auto = step_graphs is None  # on where the run allows it (module docstring)
        self._captured = None  # the CapturedStep of step_graphs=True, made on the first training step
        self._staging = None  # the staging folder of a checkpoint being written
        self._eager_step = None  # the optimizer's own step, replaced while steps are captured
        self._unchecked = []  # the captured steps' finiteness not read yet (`step_graphs.ASYNC`)
        self._nan_filter = None  # the Trainer's logging_nan_inf_filter, off while steps are captured
        self._host_base_lr = None  # the first group's base learning rate, read at the first captured step
        self.checkpoint_extras = []  # callables(folder) writing more state into each checkpoint before it is sealed
        super().__init__(*args, **kwargs)
        self._one_gpu_outside_torchrun()
        from ..data import IntegerGroupIds

        self.data_collator = IntegerGroupIds(self.data_collator)  # string (any hashable) pair_group ids collate
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
        if self._graphs_auto:
            reason = self._graphs_unavailable()
            self.step_graphs = reason is None
            if reason and reason != NOT_ON_A_GPU:
                eager_warning(reason)
        self.keep_groups = keep_groups
        self.check_finite = bool(check_finite)
        self._last_info = None
        self._info_sum = {}
        self._info_count = 0
        self._warned_no_pairs = False
        self._distributed = None  # the DistributedObjective, made on the first step under DDP
        self._objective_loaded = False  # a resumed run: each rank's generator comes from the checkpoint

    def _one_gpu_outside_torchrun(self):
        """Several GPUs without torchrun (`transformers.TrainingArguments.n_gpu` > 1, not distributed): the Trainer
        would run the model under `torch.nn.DataParallel`, which an objective's passes bypass (it calls the model's
        modules itself); one GPU trains instead, at the batch size per device, with one warning."""
        from transformers.training_args import ParallelMode

        n = self.args.n_gpu
        if n > 1 and self.args.parallel_mode == ParallelMode.NOT_DISTRIBUTED:
            warnings.warn(SingleGPUWarning(n), stacklevel=3)
            self.args._n_gpu = 1
            self._train_batch_size = self.args.train_batch_size

    def train(self, *args, **kwargs):
        self._unchecked = []
        try:
            out = super().train(*args, **kwargs)
            self._check_steps(wait=True)  # the last captured steps' finiteness
            return out
        finally:
            self._unchecked = []
            self._restore_nan_filter()
            if world() > 1:
                self._release_step_graphs()

    # ------------------------------------------------------------------ data
    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if self._signature_columns is not None:
            self._signature_columns = list(self._signature_columns) + [
                c for c in self._columns() if c not in self._signature_columns
            ]

    def _columns(self):
        """The batch columns that are not the model's inputs: those the objectives require (`Requirement`)."""
        return tuple(dict.fromkeys(objectives.batch_columns() + self.objective.batch_columns()))

    def _group_ids(self):
        """The ``pair_group`` column when batches should keep groups whole, else None."""
        dataset = self.train_dataset
        names = getattr(dataset, "column_names", None) or []
        wanted = self.keep_groups
        if wanted is None:
            wanted = self.objective.pairs_required()
        if not wanted:
            return None
        if "pair_group" not in names:
            if self.keep_groups:
                raise ValueError("keep_groups=True needs a 'pair_group' column in train_dataset")
            return None
        return list(dataset["pair_group"])

    def get_train_dataloader(self):
        with self.host_batches():
            return self._train_dataloader()

    def _train_dataloader(self):
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
        columns = self._columns()
        plain = {k: v for k, v in inputs.items() if k not in columns}
        if num_items_in_batch is not None:
            kwargs = {**kwargs, "num_items_in_batch": num_items_in_batch}
        return super().compute_loss(model, plain, return_outputs=return_outputs, **kwargs)

    # ------------------------------------------------------------------ step_graphs=True
    def create_optimizer(self, *args, **kwargs):
        """The Trainer's optimizer over the model's parameters and the objective's own (a learned gate: weight decay
        on its matrices only); with ``step_graphs``, its AdamW parameter groups in a fused AdamW (capturable on a GPU)
        whose learning rate is a tensor (module docstring)."""
        if self.optimizer is not None:
            return super().create_optimizer(*args, **kwargs)
        a = self.args
        optim = str(getattr(a.optim, "value", a.optim))
        if self.step_graphs and optim not in ("adamw_torch", "adamw_torch_fused"):
            raise StepGraphsError(f"it trains with a fused AdamW: TrainingArguments(optim={optim!r}) is not one (use "
                                  "'adamw_torch_fused', or pass optimizers=(a fused AdamW, scheduler))")
        made = super().create_optimizer(*args, **kwargs)
        held = {id(p) for g in made.param_groups for p in g["params"]}
        own = [p for p in self.objective.parameters() if p.requires_grad and id(p) not in held]
        for params, decay in (([p for p in own if p.ndim >= 2], a.weight_decay), ([p for p in own if p.ndim < 2], 0.0)):
            if params:
                made.add_param_group({"params": params, "weight_decay": decay})
        if not self.step_graphs:
            return made
        device = next(self.model.parameters()).device
        groups = [{"params": g["params"], "weight_decay": g.get("weight_decay", a.weight_decay)}
                  for g in made.param_groups]
        self.optimizer = torch.optim.AdamW(groups, lr=torch.tensor(float(a.learning_rate), device=device),
                                           betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon, fused=True,
                                           capturable=device.type == "cuda")
        return self.optimizer

    def training_step(self, model, inputs, *args, **kwargs):
        if self.step_graphs:
            return self._graph_training_step(model, inputs)
        try:
            loss = super().training_step(model, inputs, *args, **kwargs)
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

    def _non_finite_message(self, loss, step=None, info=None):
        step = self.state.global_step + 1 if step is None else step
        info = self._last_info if info is None else info
        terms = [k for k, v in (info or {}).items()
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
            call = self._distributed_objective(inner)
        elif unwrap_model(inner) is not inner:
            raise ValueError(f"{type(inner).__name__}: cat_fast's objectives run under DistributedDataParallel "
                             "(torchrun) only, not FSDP or DeepSpeed: the objective would bypass the wrapper")
        elif objective.compiled_model is None and inner is objective.model:
            objective.compiled_model = compiled_wrapper(model)  # the wrapper torch_compile=True made, if any
        batch, args = self._objective_arguments(inputs)
        with self.accelerator.autocast():
            loss, info = call(batch, *args)
        self._record(info)
        return (loss, None) if return_outputs else loss

    def _distributed_objective(self, ddp):
        """The objective run inside `ddp`'s forward (`cat_fast.distributed.DistributedObjective`), made once."""
        if self._distributed is None or self._distributed.ddp is not ddp:
            from ..distributed import DistributedObjective

            self._distributed = DistributedObjective(self.objective, ddp, reseed=not self._objective_loaded)
        return self._distributed

    def _objective_arguments(self, inputs):
        """(batch, args) of the objective's call: the pairs of an objective that requires them (module docstring;
        `Objective.call_arguments`)."""
        return self.objective.call_arguments(inputs)

    def _record(self, info):
        self._last_info = info
        for k, v in info.items():  # summed on the device: no host sync in the step
            v = v.detach().float() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
            self._info_sum[k] = v if k not in self._info_sum else self._info_sum[k] + v.to(self._info_sum[k].device)
        self._info_count += 1

    def log(self, logs, *args, **kwargs):
        if self._info_count and "loss" in logs:
            logs = dict(logs)
            means = {k: float(v) / self._info_count for k, v in self._info_sum.items()}
            logs.update({f"{self._log_prefix}/{k}": v for k, v in means.items()})
            self._info_sum, self._info_count = {}, 0
            if self.objective.pairs_required() and means.get("gs_pairs", 1.0) == 0 and not self._warned_no_pairs:
                self._warned_no_pairs = True
                warnings.warn(f"{type(self).__name__}: no training step since the last log saw a counterfactual "
                              "pair with another label in its batch, so the GS term is 0 (plain ERM): keep groups "
                              "in one batch (a 'pair_group' column; keep_groups=True) or check the pairs",
                              RuntimeWarning, stacklevel=2)
        return super().log(logs, *args, **kwargs)


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

