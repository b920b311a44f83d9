"""`ObjectiveTrainer`'s checkpoints (the trainer module's docstring): the Trainer's checkpoint and the objective's
state written atomically (`cat_fast.integrations.checkpoints`: staged, sealed by a manifest, renamed, then rotated),
resumed only from a complete one, the objective's state read without running code."""
from __future__ import annotations

import os

import torch

from . import checkpoints

__all__ = ["TrainerCheckpoints", "OBJECTIVE_STATE"]

OBJECTIVE_STATE = "cat_fast_objective.pt"  # the objective's state inside a checkpoint folder


class TrainerCheckpoints:
    """The checkpoint methods of `ObjectiveTrainer` (a mixin of the Trainer: it reads ``args``, ``state``,
    ``accelerator``, ``objective``, ``checkpoint_extras`` and ``_staging``)."""

    def _get_output_dir(self, trial):
        if self._staging is not None:  # a checkpoint being written: the Trainer writes into the staging folder
            return self._staging
        return super()._get_output_dir(trial=trial)

    def _save_checkpoint(self, model, trial, *args, **kwargs):
        """The Trainer's checkpoint and the objective's state, written atomically (`checkpoints`): staged, sealed
        by a manifest, renamed into place, and only then are older checkpoints rotated away. The captured steps'
        finiteness not read yet is read first (`step_graphs.ASYNC`): a non-finite step stops the run before its
        checkpoint is written, as it does without step graphs."""
        check = getattr(self, "_check_steps", None)
        if check is not None:
            check(wait=True)
        run_dir = self._get_output_dir(trial=trial)
        step = self.state.global_step
        staging = checkpoints.staging_dir(run_dir, step)
        main = self.args.should_save
        if main:
            checkpoints.remove_leftovers(run_dir)
            os.makedirs(staging)
        self.accelerator.wait_for_everyone()
        self._staging = staging
        limit, self.args.save_total_limit = self.args.save_total_limit, None  # rotated below, after the rename
        try:
            super()._save_checkpoint(model, trial, *args, **kwargs)
            folder = os.path.join(staging, f"{checkpoints.PREFIX}{step}")
            os.makedirs(folder, exist_ok=True)
            torch.save(self.objective.state_dict(), os.path.join(folder, _objective_file(self.args.process_index)))
            for extra in self.checkpoint_extras:  # more state of the run, sealed in with the checkpoint
                extra(folder)
        finally:
            self._staging = None
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()  # every rank's files are in the staging folder
        if main:
            final = checkpoints.finish(run_dir, step)
            if self.state.best_model_checkpoint and self.state.best_model_checkpoint.startswith(staging):
                self.state.best_model_checkpoint = final
            checkpoints.rotate(run_dir, limit)
        self.accelerator.wait_for_everyone()

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True:  # the newest COMPLETE checkpoint, not merely the highest-numbered folder
            found = checkpoints.last_complete(self.args.output_dir)
            if found is None:
                raise checkpoints.CheckpointError(f"resume_from_checkpoint=True: no complete checkpoint in "
                                                  f"{self.args.output_dir}")
            resume_from_checkpoint = found
        elif isinstance(resume_from_checkpoint, str) and not checkpoints.is_complete(resume_from_checkpoint):
            raise checkpoints.CheckpointError(
                f"resume_from_checkpoint={resume_from_checkpoint!r}: not a complete checkpoint (no "
                f"{checkpoints.COMPLETE} matching its files: written by an interrupted save?)")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint, *args, **kwargs):
        super()._load_from_checkpoint(resume_from_checkpoint, *args, **kwargs)
        path = os.path.join(resume_from_checkpoint, _objective_file(self.args.process_index))
        if not os.path.isfile(path):
            raise checkpoints.CheckpointError(f"{resume_from_checkpoint}: no {os.path.basename(path)} (the "
                                              "objective's state of this rank)")
        try:  # tensors and plain containers only: a crafted file cannot run code here
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise checkpoints.CheckpointError(f"{path}: cannot read the objective's state ({type(error).__name__}: "
                                              f"{' '.join(str(error).split())[:200]})") from error
        self.objective.load_state_dict(state)
        self._objective_loaded = True


def _objective_file(rank):
    return OBJECTIVE_STATE if rank == 0 else OBJECTIVE_STATE.replace(".pt", f".rank{rank}.pt")
