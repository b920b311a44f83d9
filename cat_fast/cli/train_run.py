"""``cat-fast train``'s Trainer: LoRA wrapping, the `ObjectiveTrainer` over the run's batch stream with its dev
evaluations, the training itself with its failures mapped to one-line errors, and the per-epoch history."""
from __future__ import annotations

import contextlib
import shutil
import sys
from typing import Dict, List

from .common import CliError, TrainingFailed

__all__ = ["with_lora", "make_trainer", "run_trainer", "history_of", "Scratch", "finish", "step_graph_warnings"]


def with_lora(model, args):
    """``--lora R``: LoRA adapters of rank R (peft) on the target projections, trained with the classification
    head; everything else frozen. The model object stays the Hugging Face model (its projections wrapped in place),
    so the objectives drive it as before; the returned PeftModel merges the adapters into it for the checkpoint.
    The fast layers read each adapted projection as one weight, W + scaling · B @ A (`layers.layout.projection`);
    a --lora-dropout above 0 keeps them off while training, and the model's `AdapterWarning` says so."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise CliError("--lora needs peft: pip install 'cat_fast[lora]'") from None
    from .. import models

    targets = [t for t in (args.lora_target_modules or "").split(",") if t] or None
    config = LoraConfig(r=args.lora, lora_alpha=args.lora_alpha if args.lora_alpha is not None else 2 * args.lora,
                        lora_dropout=args.lora_dropout, target_modules=targets)
    try:
        wrapped = get_peft_model(model, config)
    except ValueError as error:
        raise CliError(f"--lora-target-modules {args.lora_target_modules or '(peft default)'}: "
                       f"{' '.join(str(error).split())[:200]}") from error
    for p in models.structure(model).head.parameters():
        p.requires_grad_(True)
    return wrapped


def make_trainer(args, model, objective, parts, output_dir, plan, world, device):
    """The `ObjectiveTrainer` over the stream `parts` (items, batch sampler, collate function), logging the last
    epoch's dev accuracy with that step's loss and showing the loss on its progress bar."""
    import torch
    from transformers.trainer_callback import ProgressCallback

    from ..integrations.trainer import ObjectiveTrainer
    from .trainer_args import loader_kwargs, training_arguments

    items, stream, collate = parts

    class Run(ObjectiveTrainer):
        pending: Dict = {}  # the last epoch's dev accuracy, logged with that step's loss

        def get_train_dataloader(self):
            kwargs = loader_kwargs(getattr(args, "trainer_args", None))
            if self.host_batches_apply():  # pinned: the captured step moves each batch without waiting for the GPU
                kwargs.setdefault("pin_memory", True)
            loader = torch.utils.data.DataLoader(items, batch_sampler=stream, collate_fn=collate, **kwargs)
            with self.host_batches(pinned=kwargs.get("pin_memory", False)):
                return self.accelerator.prepare(loader)

        def log(self, logs, *a, **k):
            if self.pending and "loss" in logs:
                logs, self.pending = {**logs, **self.pending}, {}
            return super().log(logs, *a, **k)

    class Quiet(ProgressCallback):
        """The Trainer's progress bar, without printing every log line."""

        def on_log(self, targs, state, control, logs=None, **kw):
            if self.training_bar is not None and logs:
                shown = {k: f"{v:.4f}" for k, v in logs.items() if k in ("loss", "eval/dev/accuracy")}
                if shown:
                    self.training_bar.set_postfix(shown, refresh=False)

    find_unused = objective.find_unused_parameters if world > 1 else None
    targs = training_arguments(args, output_dir, plan.total_steps, plan.lr_warm, find_unused, world, device)
    with step_graph_warnings():
        trainer = Run(model=model, args=targs, train_dataset=items, objective=objective,
                      step_graphs=getattr(args, "step_graphs", None))
    trainer.pending = {}
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(Quiet)
    if callable(getattr(objective, "epoch_record", None)):
        trainer.add_callback(_epoch_records(trainer, objective, plan.ends))
    return trainer


def _epoch_records(trainer, objective, ends):
    """A callback: at each epoch's end, the objective's ``epoch_record()`` (a dict of JSON values, or None) logged
    with that step's loss as ``cat_fast_record``; `history_of` puts its keys into the epoch's summary."""
    from transformers import TrainerCallback

    class EpochRecords(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            if state.global_step in ends:
                record = objective.epoch_record()
                if record:
                    entry = {"epoch": ends.index(state.global_step) + 1, "record": record}
                    trainer.pending = {**trainer.pending, "cat_fast_record": entry}
                    control.should_log = True
            return control

    return EpochRecords()


def run_trainer(trainer, folder, method: str, rank: int) -> None:
    """``trainer.train()`` (resuming from ``folder.resume_from``), its failures as one-line errors; an interrupt
    keeps the checkpoints for ``--resume``."""
    from ..integrations.checkpoints import CheckpointError
    from ..integrations.trainer import NonFiniteLossError, StepGraphsError

    try:
        with step_graph_warnings():
            trainer.train(resume_from_checkpoint=folder.resume_from)
    except NonFiniteLossError as error:
        kept = folder.close(failed=True) if rank == 0 else None
        where = f" (the checkpoints it resumed from are kept in {kept})" if kept else ""
        raise TrainingFailed(f"{error}; no output written{where} (check the hyper-parameters, or lower --lr)"
                             ) from error
    except StepGraphsError as error:
        if rank == 0:
            folder.close(failed=True)
        raise CliError(f"--step-graphs --method {method}: {error.reason}") from error
    except CheckpointError as error:
        raise CliError(f"--resume: {error}") from error
    except KeyboardInterrupt:
        if rank == 0 and folder.has_checkpoint():
            sys.stderr.write(f"cat-fast: checkpoints kept in {folder.path}: run the same command with --resume "
                             "to continue\n")
        elif rank == 0:
            folder.close()
        raise


@contextlib.contextmanager
def step_graph_warnings():
    """The trainer's `StepGraphsWarning` as one ``cat-fast: warning:`` line naming the CLI's flag."""
    import warnings

    from ..integrations.trainer import StepGraphsWarning

    shown = warnings.showwarning

    def show(message, category, *args, **kwargs):
        if isinstance(message, StepGraphsWarning):
            sys.stderr.write(f"cat-fast: warning: the eager training step runs: {message.reason} (--no-step-graphs "
                             "silences this)\n")
        else:
            shown(message, category, *args, **kwargs)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


class Scratch:
    """The output directory of a rank other than 0: a scratch directory that nothing is committed from."""

    def __enter__(self):
        import tempfile

        self.tmp = tempfile.mkdtemp(prefix="cat-fast-rank-")
        return self.tmp

    def __exit__(self, *exc):
        shutil.rmtree(self.tmp, ignore_errors=True)
        return False


def finish(world: int) -> None:
    """Under torchrun: wait for every rank (rank 0 writes its outputs first), then leave the process group.

    The caller drops its trainer first; `cat_fast.distributed.leave` collects the garbage before destroying the group
    (a DDP reducer that outlived it would drop the group's last reference while holding the GIL)."""
    if world > 1:
        import torch.distributed as dist

        from ..distributed import leave

        if dist.is_initialized():
            dist.barrier()
        leave()


def history_of(logs: List[Dict], ends: List[int], cat_active_from: int, method: str) -> List[Dict]:
    """Per-epoch summaries (train loss and info means over the epoch's logged steps, dev accuracy) from the
    Trainer's log history."""
    history, start = [], 0
    evals = {int(h["cat_fast_epoch"]): h for h in logs if "cat_fast_epoch" in h}
    records = {int(h["cat_fast_record"]["epoch"]): h["cat_fast_record"]["record"] for h in logs
               if "cat_fast_record" in h}  # the objective's epoch_record()
    for e, end in enumerate(ends, 1):
        steps = [h for h in logs if "loss" in h and start < h.get("step", 0) <= end]
        info_keys = sorted({k for h in steps for k in h if "/" in k and not k.startswith("eval/")})
        ev = evals.get(e, {})
        names = sorted({k.split("/")[1] for k in ev if k.startswith("eval/")})
        history.append({
            "epoch": e,
            "step": end,
            "objective": "erm" if e <= cat_active_from else method,
            "train_loss": sum(h["loss"] for h in steps) / len(steps) if steps else float("nan"),
            "info": {k.split("/", 1)[1]: sum(h[k] for h in steps if k in h) / max(1, sum(k in h for h in steps))
                     for k in info_keys},
            "eval": {n: {"accuracy": ev[f"eval/{n}/accuracy"], "n": int(ev[f"eval/{n}/n"])} for n in names},
            **records.get(e, {}),
        })
        start = end
    return history
