"""The whole-step CUDA graph of `ObjectiveTrainer` (``step_graphs``; the trainer module's docstring): when a run can
take it, the first step's `cat_fast.step.CapturedStep`, each step through it, and the fall-back to the eager step
with one warning saying why."""
from __future__ import annotations

import warnings

import torch

from ..models import orig_module
from ..step import CapturedStep, NotCapturable

__all__ = ["StepGraphs", "StepGraphsError", "StepGraphsWarning", "NonFiniteLossError", "eager_warning", "NOT_ON_A_GPU"]


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite (the message names the step and the term)."""


class StepGraphsError(ValueError):
    """What ``step_graphs=True`` cannot run (``reason``: the problem, naming the argument)."""

    def __init__(self, reason):
        super().__init__(f"step_graphs=True: {reason}")
        self.reason = reason


NOT_ON_A_GPU = "not on a GPU"


class StepGraphsWarning(UserWarning):
    """``step_graphs=None`` runs the eager training step (``reason`` says why)."""

    def __init__(self, reason):
        super().__init__(f"ObjectiveTrainer: the eager training step runs: {reason} (step_graphs=False silences "
                         "this)")
        self.reason = reason


def eager_warning(reason):
    warnings.warn(StepGraphsWarning(reason), stacklevel=3)


class StepGraphs:
    """`ObjectiveTrainer`'s captured training step (a mixin of the Trainer: it reads ``args``, ``model``,
    ``optimizer``, ``objective``, ``state`` and the trainer's ``_record`` / ``_objective_arguments``)."""

    def _graphs_unavailable(self, required: bool = False):
        """Why the captured step cannot run here (module docstring), or None. `required` (``step_graphs=True``, or
        the first step of the default's): what the captured step needs of the run; otherwise also what the default
        turns it on for (a GPU; a fused AdamW with a tensor learning rate, or an AdamW the trainer makes)."""
        a = self.args
        if not required:
            param = next(self.model.parameters(), None)
            if param is None or param.device.type != "cuda":
                return NOT_ON_A_GPU
        if a.gradient_accumulation_steps != 1:
            return (f"gradient_accumulation_steps must be 1 (one captured step per optimizer step), got "
                    f"{a.gradient_accumulation_steps}")
        if a.fp16:
            return "bf16 or fp32 (fp16's loss scaling is not part of the captured step)"
        if required:
            return None
        if self.optimizer is not None:
            raw = getattr(self.optimizer, "optimizer", self.optimizer)
            if not all(g.get("fused") and isinstance(g["lr"], torch.Tensor) for g in raw.param_groups):
                return "the optimizer given is not fused with a tensor learning rate (fused=True, lr=torch.tensor(...))"
        else:
            optim = str(getattr(a.optim, "value", a.optim))
            if optim not in ("adamw_torch", "adamw_torch_fused"):
                return f"TrainingArguments(optim={optim!r}) is not AdamW"
        return None

    def _fall_back_to_eager(self, reason):
        """``step_graphs=None``: a step the captured step cannot take (refused before any state changed) runs
        eagerly from now on, with one warning."""
        eager_warning(reason)
        self.step_graphs = False
        self._release_step_graphs()

    def _release_step_graphs(self):
        """Drops the captured step and gives the Trainer its optimizer step back; a later training step captures
        again. Under torchrun this runs when `train` returns: graphs holding captured NCCL collectives that outlive
        their process group make ``destroy_process_group`` wait for ever."""
        if self._captured is None:
            return
        self._captured = None
        if self._eager_step is not None:  # the Trainer steps the optimizer again, as the LR scheduler wrapped it
            self.optimizer.step = self._eager_step
        else:
            self.optimizer.__dict__.pop("step", None)

    def _graph_step_setup(self, model):
        """The CapturedStep of the first step, after checking what step_graphs needs (module docstring)."""
        a = self.args
        problem = self._graphs_unavailable(required=True)
        if problem:
            raise StepGraphsError(problem)
        raw = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's AcceleratedOptimizer wraps it
        target = self.objective
        inner = orig_module(model)
        if isinstance(inner, torch.nn.parallel.DistributedDataParallel):  # torchrun: every rank builds it here
            target = self._distributed_objective(inner)
        try:
            captured = CapturedStep(target, raw, max_grad_norm=a.max_grad_norm if a.max_grad_norm > 0 else None,
                                    autocast=torch.bfloat16 if a.bf16 else None, skip_non_finite=True, strict=True,
                                    max_graphs=64)
        except ValueError as error:
            raise StepGraphsError(str(error)) from error
        for group in raw.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                raise StepGraphsError("optimizer: the learning rate must be a tensor (lr=torch.tensor(...), which the "
                                      "scheduler updates in place; a captured step would replay a float lr)")
        # the captured step clips and steps the optimizer itself: the Trainer's own optimizer step becomes a no-op
        # (marked as torch's LR schedulers mark the step they wrap, so they see the step as taken)
        wrapper = self.optimizer
        self._eager_step = wrapper.__dict__.get("step")

        def taken(*args, **kwargs):
            wrapper._opt_called = True

        taken._wrapped_by_lr_sched = True
        wrapper.step = taken
        return captured

    def _graph_training_step(self, model, inputs):
        if self._captured is None:
            try:
                self._captured = self._graph_step_setup(model)
            except StepGraphsError as error:
                if not self._graphs_auto:
                    raise
                self._fall_back_to_eager(error.reason)
                return self.training_step(model, inputs)
        model.train()
        inputs = self._prepare_inputs(inputs)
        objective = self.objective
        objective.step = self.state.global_step
        objective.set_optimizer(self.optimizer)  # CLP's virtual step reads its learning rate
        batch, args = self._objective_arguments(inputs)
        try:
            loss, info = self._captured(batch, *args)
        except NotCapturable as error:
            if not self._graphs_auto:
                raise StepGraphsError(str(error)) from error
            self._fall_back_to_eager(str(error))
            return self.training_step(model, inputs)
        norm = self._captured.last_grad_norm
        if norm is not None:
            info = {**info, "grad_norm": norm}
        self._record(info)
        if self.check_finite and self._distributed is not None:  # torchrun: every rank stops at the same step
            skipped = self._captured.last_skipped
            if skipped is not None and bool(skipped):
                raise NonFiniteLossError(f"a non-finite loss or gradient norm on a rank at step "
                                         f"{self.state.global_step + 1}; training stopped on every rank before the "
                                         "optimizer applied it")
        elif self.check_finite:
            values = loss.detach().float().reshape(1)
            if norm is not None:
                values = torch.cat([values, norm.detach().float().reshape(1).to(values.device)])
            if not bool(torch.isfinite(values).all()):  # the fused optimizer step skipped it on the device
                if not bool(torch.isfinite(values[0])):
                    raise NonFiniteLossError(self._non_finite_message(loss))
                raise NonFiniteLossError(f"the gradient norm became {float(values[1])} at step "
                                         f"{self.state.global_step + 1}; training stopped before the optimizer "
                                         "applied it")
        return loss.detach()
