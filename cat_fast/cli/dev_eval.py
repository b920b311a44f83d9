"""Dev evaluation during ``cat-fast train``: at the end of each epoch and every ``--eval-steps`` optimizer steps,
with the best model kept (``--keep-best``) and early stopping (``--early-stopping-patience``).

Rank 0 evaluates; the stop decision is broadcast so every rank stops at the same step. The best weights and the
counters are part of every checkpoint (``cat_fast_dev.json`` and ``cat_fast_best.safetensors``, written through
`ObjectiveTrainer.checkpoint_extras`), so a resumed run keeps what the uninterrupted run would have kept.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

from transformers import TrainerCallback

__all__ = ["DevEvaluation", "STATE_FILE", "BEST_FILE"]

STATE_FILE = "cat_fast_dev.json"
BEST_FILE = "cat_fast_best.safetensors"


class DevEvaluation(TrainerCallback):
    """Dev accuracy at the end of each epoch (``ends``: the step each epoch ends at) and every `eval_steps` steps,
    handed to `log` (a callable taking the logs) with that step's loss; the best model and early stopping by
    ``dev`` accuracy (module docstring)."""

    def __init__(self, ends: List[int], evaluate, log, model, *, eval_steps: Optional[int] = None,
                 keep_best: bool = False, patience: Optional[int] = None, rank: int = 0, world: int = 1):
        self.ends, self.evaluate, self.log, self.model = ends, evaluate, log, model
        self.eval_steps, self.keep_best, self.patience = eval_steps, keep_best, patience
        self.rank, self.world = rank, world
        self.next = 0
        self.best: Optional[float] = None  # the best dev accuracy so far
        self.best_step: Optional[int] = None
        self.since_best = 0  # evaluations since the best one
        self.best_state: Optional[Dict] = None  # the best weights (CPU copies; rank 0)
        self.stopped_at: Optional[int] = None

    # -- checkpoints
    def save(self, folder: str) -> None:
        """Into a checkpoint being written (`ObjectiveTrainer.checkpoint_extras`)."""
        if self.rank != 0:
            return
        with open(os.path.join(folder, STATE_FILE), "w") as f:
            json.dump({"best": self.best, "best_step": self.best_step, "since_best": self.since_best}, f)
        if self.best_state is not None:
            from safetensors.torch import save_file

            save_file(self.best_state, os.path.join(folder, BEST_FILE))

    def restore(self, folder: Optional[str]) -> None:
        """From the checkpoint a resume starts at (no file: a checkpoint of a run without them)."""
        if folder is None or not os.path.isfile(os.path.join(folder, STATE_FILE)):
            return
        with open(os.path.join(folder, STATE_FILE)) as f:
            saved = json.load(f)
        self.best, self.best_step, self.since_best = saved["best"], saved["best_step"], int(saved["since_best"])
        path = os.path.join(folder, BEST_FILE)
        if self.rank == 0 and os.path.isfile(path):
            from safetensors.torch import load_file

            self.best_state = load_file(path)

    # -- the callback
    def on_train_begin(self, targs, state, control, **kw):
        self.next = sum(1 for e in self.ends if e <= state.global_step)

    def on_step_end(self, targs, state, control, **kw):
        step = state.global_step
        epoch_end = False
        while self.next < len(self.ends) and step >= self.ends[self.next]:
            self.next += 1
            epoch_end = True
        periodic = bool(self.eval_steps) and step % self.eval_steps == 0 and step < self.ends[-1]
        if not (epoch_end or periodic):
            return control
        logs = {"cat_fast_epoch": float(self.next)} if epoch_end else {"cat_fast_eval_step": float(step)}
        stop = False
        if self.rank == 0:
            scores = self.evaluate()
            for name, value in (scores or {}).items():
                logs[f"eval/{name}/accuracy"] = value["accuracy"]
                logs[f"eval/{name}/n"] = float(value["n"])
            if scores and "dev" in scores:
                stop = self._judge(scores["dev"]["accuracy"], step)
        self.log(logs)
        control.should_log = True
        if self.patience is not None and self._agree(stop):
            self.stopped_at = step
            control.should_training_stop = True
        return control

    def _judge(self, accuracy: float, step: int) -> bool:
        """Record a dev accuracy; True when early stopping should stop here."""
        if self.best is None or accuracy > self.best:
            self.best, self.best_step, self.since_best = accuracy, step, 0
            if self.keep_best:
                self.best_state = {k: v.detach().to("cpu", copy=True).contiguous()
                                   for k, v in self.model.state_dict().items()}
            return False
        self.since_best += 1
        return self.patience is not None and self.since_best >= self.patience

    def _agree(self, stop: bool) -> bool:
        """Rank 0's decision on every rank."""
        if self.world == 1:
            return stop
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if stop else 0.0], device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.broadcast(flag, 0)
        return bool(flag.item())

    def load_best(self) -> bool:
        """Put the best weights into the model (rank 0); False when there are none."""
        if self.best_state is None:
            return False
        self.model.load_state_dict(self.best_state)
        return True
