"""The whole-step CUDA graph of `ObjectiveTrainer` (``step_graphs``; the trainer module's docstring): when a run can
take it, the first step's `cat_fast.step.CapturedStep`, each step through it, and the fall-back to the eager step
with one warning saying why."""
from __future__ import annotations

import contextlib
import warnings

import torch

from ..distributed import world
from ..models import orig_module
from ..step import CapturedStep, NotCapturable

__all__ = ["StepGraphs", "StepGraphsError", "StepGraphsWarning", "NonFiniteLossError", "eager_warning", "NOT_ON_A_GPU"]

# The captured training step waits for nothing on the GPU, so that the host prepares the next step while the GPU
# runs this one: its finiteness (``check_finite``) is copied to the host behind it and read at the next step (a
# non-finite step, skipped on the device by the fused optimizer, stops training at the next step, or when `train`
# returns), the learning rate the Trainer logs is computed on the host (the schedule's factor times the base rate),
# the Trainer's NaN filter of the logged loss is off while non-finite losses stop training anyway, and on one
# process the training batches stay on the host (pinned) until the step moves them, reading its packed row counts
# from the host mask. False: each step's values read at once (several host synchronisations a step).
ASYNC = True
# the steps whose finiteness is left unread when a captured step returns (`ASYNC`): the step before is read (its GPU
# work done by then, or waited for while this one is queued)
UNCHECKED_STEPS = 1


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
        first = raw.param_groups[0]
        base = first.get("initial_lr", first["lr"])  # read once, for `_get_learning_rate`
        self._host_base_lr = base.detach().cpu() if isinstance(base, torch.Tensor) else torch.tensor(float(base))
        return captured

    def _restore_nan_filter(self):
        if self._nan_filter is not None:
            self.args.logging_nan_inf_filter, self._nan_filter = self._nan_filter, None

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
        if ASYNC and self.check_finite and self.args.logging_nan_inf_filter:
            # a non-finite loss stops training: the Trainer's filter of it (a host synchronisation a step) is off
            # until `train` returns
            self._nan_filter, self.args.logging_nan_inf_filter = True, False
        host = ASYNC and _on_host(inputs)  # the loader left it on the host (`host_batches`): the step moves it
        if not host:
            inputs = self._prepare_inputs(inputs)
        objective = self.objective
        objective.step = self.state.global_step
        objective.set_optimizer(self.optimizer)  # CLP's virtual step reads its learning rate
        batch, args = self._objective_arguments(inputs)
        if host:
            device = next(model.parameters()).device
            args = tuple(a.to(device, non_blocking=True) if isinstance(a, torch.Tensor) else a for a in args)
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
        if self.check_finite:
            self._unchecked.append(self._step_flags(loss, norm, info))
            self._check_steps(wait=not ASYNC)
        return loss.detach()

    def _step_flags(self, loss, norm, info):
        """``(step, kind, flags, info, event)`` of this step for `_check_steps`: its number, its finiteness (under
        torchrun the ranks' skip flag, else its loss and gradient norm) copied to the host behind the step (pinned,
        without waiting), and the event after which that copy holds them (None off CUDA); None: nothing to read."""
        step = self.state.global_step + 1
        if self._distributed is not None:  # torchrun: every rank stops at the same step
            skipped = self._captured.last_skipped
            if skipped is None:
                return None
            flags, kind = skipped.reshape(1), "skipped"
        else:
            flags = loss.detach().float().reshape(1)
            if norm is not None:
                flags = torch.cat([flags, norm.detach().float().reshape(1).to(flags.device)])
            kind = "values"
        event = None
        if flags.is_cuda:
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            flags = host
        return step, kind, flags, info, event

    def _check_steps(self, wait=False):
        """`NonFiniteLossError` for the first step not finite (the fused optimizer skipped it on the device) among
        all but the last `UNCHECKED_STEPS` steps (`wait`: all), waiting for their flags to reach the host. The
        steps read are the same on every rank, so under torchrun every rank stops at the same step."""
        pending = self._unchecked
        while len(pending) > (0 if wait else UNCHECKED_STEPS):
            flags = pending.pop(0)
            if flags is None:
                continue
            step, kind, values, info, event = flags
            if event is not None:
                event.synchronize()
            if kind == "skipped":
                if bool(values[0]):
                    pending.clear()
                    raise NonFiniteLossError(f"a non-finite loss or gradient norm on a rank at step {step}; "
                                             "training stopped on every rank before the optimizer applied it")
                continue
            if not bool(torch.isfinite(values).all()):
                pending.clear()
                if not bool(torch.isfinite(values[0])):
                    raise NonFiniteLossError(self._non_finite_message(values[0], step, info))
                raise NonFiniteLossError(f"the gradient norm became {float(values[1])} at step {step}; training "
                                         "stopped before the optimizer applied it")

    # ------------------------------------------------------------------ no host synchronisation per step
    def host_batches_apply(self) -> bool:
        """Whether the training batches stay on the host (`host_batches`): one process, step graphs on a GPU."""
        param = next(self.model.parameters(), None)
        return (ASYNC and self.step_graphs is not False and world() == 1 and param is not None
                and param.device.type == "cuda")

    @contextlib.contextmanager
    def host_batches(self, pinned=None):
        """While the training loader is prepared: where `host_batches_apply` and its batches are pinned (`pinned`,
        default ``args.dataloader_pin_memory``), accelerate leaves them on the host; the captured step moves them
        without waiting for the GPU and counts their packed rows from the host mask."""
        accelerator = self.accelerator
        placed = accelerator.device_placement
        if self.host_batches_apply() and (self.args.dataloader_pin_memory if pinned is None else pinned):
            accelerator.device_placement = False
        try:
            yield
        finally:
            accelerator.device_placement = placed

    def _get_learning_rate(self):
        """The Trainer's logged learning rate; while steps are captured with a tensor rate under a `LambdaLR`
        schedule (the Trainer's), computed on the host from the base rate read at the first step."""
        scheduler = getattr(self, "lr_scheduler", None)
        if (ASYNC and self._captured is not None and self._host_base_lr is not None
                and type(scheduler) is torch.optim.lr_scheduler.LambdaLR and len(scheduler.lr_lambdas) >= 1):
            # the device's arithmetic (the rate's dtype times the schedule's factor), on a host copy
            return float(self._host_base_lr * scheduler.lr_lambdas[0](scheduler.last_epoch))
        return super()._get_learning_rate()


def _on_host(inputs) -> bool:
    """Whether `inputs` is a dict whose tensors are all pinned CPU tensors (a batch `host_batches` left there)."""
    tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor)] if isinstance(inputs, dict) else []
    return bool(tensors) and all(t.device.type == "cpu" and t.is_pinned() for t in tensors)
