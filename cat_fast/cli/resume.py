"""The checkpoint folder of ``cat-fast train`` (``DIR.checkpoints``): whose it is, which run it belongs to, and what
is removed when.

* cat-fast writes checkpoints only into a folder it made (its ``.cat-fast`` marker) or an empty one; a non-empty
  folder it did not write is refused, never emptied.
* The folder records the run it belongs to (``cat_fast_run.json``: every option that shapes the training, and a
  fingerprint of the training rows). ``--resume`` continues from the newest COMPLETE checkpoint
  (`cat_fast.integrations.checkpoints`) and refuses a run whose options or data differ, naming the fields; a new run
  (no ``--resume``) refuses a folder holding another run's checkpoints unless ``--overwrite``.
* When the run completes, and when it fails (a non-finite loss), the checkpoints it wrote are removed, and the
  folder too when nothing else is left in it; an interrupt keeps them for ``--resume``.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, List, Optional

from ..integrations import checkpoints as ckpt
from .common import MARKER, CliError, mark_output

__all__ = ["RUN_FILE", "NEUTRAL_OPTIONS", "data_fingerprint", "CheckpointFolder"]

RUN_FILE = "cat_fast_run.json"

# options that do not change what is trained: they may differ between a run and its resumption
NEUTRAL_OPTIONS = frozenset({"command", "resume", "overwrite", "save_steps", "save_total_limit", "logging_steps",
                             "report_to", "device", "eval", "eval_batch_size", "no_checkpoint", "out",
                             "ddp_bucket_mb", "keep_checkpoints",
                             "objective_config"})  # the file the options came from: the options themselves count


def data_fingerprint(data) -> str:
    """sha256 over the training rows in order: id, text, text pair and label of each."""
    h = hashlib.sha256()
    pairs = data.text_pair if data.text_pair is not None else [None] * len(data)
    for row in zip(data.ids, data.text, pairs, data.labels):
        h.update(json.dumps(row, ensure_ascii=False).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _short(value) -> str:
    s = json.dumps(value)
    return s if len(s) <= 60 else s[:57] + "..."


class CheckpointFolder:
    """``DIR.checkpoints`` of one run (module docstring). ``check()`` before anything is written; ``open()`` when
    training starts (rank 0); ``resume_from`` is the checkpoint a ``--resume`` continues from."""

    def __init__(self, out: str, saving: bool, resume: bool, overwrite: bool):
        self.path = os.path.abspath(out) + ".checkpoints"
        self.saving, self.resume, self.overwrite = saving, resume, overwrite
        self.resume_from: Optional[str] = None
        self.resume_step = 0
        self.created = False

    # -- before anything is written
    def check(self, record: Dict) -> None:
        """Refuse a folder that is not cat-fast's, a resume without a complete checkpoint or of another run, and a
        new run over another run's checkpoints (without --overwrite)."""
        path = self.path
        if not (self.saving or self.resume):
            return
        if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
            raise CliError(f"{path} exists and is not a directory (cat-fast keeps the checkpoints of --out there): "
                           "move it or choose another --out")
        ours = os.path.isfile(os.path.join(path, MARKER))
        if os.path.isdir(path) and os.listdir(path) and not ours:
            raise CliError(f"{path} exists, is not empty and was not written by cat-fast (no {MARKER} file in it); "
                           "cat-fast keeps the checkpoints of --out there: move it or choose another --out")
        if self.resume:
            self._check_resume(record)
        elif ours and (ckpt.complete_checkpoints(path) or os.path.isfile(os.path.join(path, RUN_FILE))):
            if not self.overwrite:
                raise CliError(f"{path} holds the checkpoints of an earlier run: pass --resume to continue it, or "
                               "--overwrite to start again (its checkpoints are then removed)")

    def _check_resume(self, record: Dict) -> None:
        path = self.path
        found = ckpt.last_complete(path) if os.path.isdir(path) else None
        if found is None:
            raise CliError(f"--resume: no complete checkpoint in {path} (checkpoints are written with --save-steps)")
        try:
            with open(os.path.join(path, RUN_FILE)) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            raise CliError(f"--resume: {path} has no readable {RUN_FILE} (the options of the run it belongs to); "
                           "start the run again without --resume") from None
        now = _normal(record)
        differ = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        if differ:
            shown = "; ".join(f"{_flag(k) if k != 'data_fingerprint' else 'the training rows'} (checkpoint: "
                              f"{_short(saved.get(k))}, now: {_short(now.get(k))})" for k in differ[:6])
            more = f" and {len(differ) - 6} more" if len(differ) > 6 else ""
            raise CliError(f"--resume: the checkpoints in {path} belong to a run with other options or data: {shown}"
                           f"{more}; resume with the same options, or start again with --overwrite")
        self.resume_from = found
        self.resume_step = ckpt.complete_checkpoints(path)[-1][0]

    # -- when training starts (rank 0)
    def open(self, record: Dict) -> None:
        if not self.saving and not self.resume:
            return
        path = self.path
        if not self.resume:
            self.remove_checkpoints(after=-1)  # --overwrite of an earlier run's checkpoints (check() allowed it)
        if not os.path.isdir(path):
            os.makedirs(path)
            self.created = True
        mark_output(path)
        ckpt.remove_leftovers(path)
        tmp = os.path.join(path, f".{RUN_FILE}.tmp")
        with open(tmp, "w") as f:
            json.dump(_normal(record), f, indent=1, sort_keys=True)
        os.replace(tmp, os.path.join(path, RUN_FILE))

    def has_checkpoint(self) -> bool:
        return bool(ckpt.complete_checkpoints(self.path)) if os.path.isdir(self.path) else False

    def remove_checkpoints(self, after: int = -1) -> List[int]:
        """Remove the checkpoints of steps > `after` (complete or not: the folder is cat-fast's) and any leftovers;
        returns the steps of the complete checkpoints kept."""
        if not os.path.isdir(self.path):
            return []
        kept = []
        for step, folder in ckpt.checkpoint_folders(self.path, complete=False):
            if step > after:
                ckpt.remove_checkpoint(folder)
            elif ckpt.is_complete(folder):
                kept.append(step)
        ckpt.remove_leftovers(self.path)
        return kept

    def close(self, failed: bool = False) -> Optional[str]:
        """After a completed run (or, with `failed`, a run that cannot go on): remove this run's checkpoints, and the
        folder when nothing else is in it. A failed resumed run keeps the checkpoints it started from; their folder
        is returned then (None otherwise)."""
        if not os.path.isdir(self.path):
            return None
        kept = self.remove_checkpoints(after=self.resume_step if failed else -1)
        if kept:
            return self.path
        for name in (RUN_FILE, MARKER):
            try:
                os.remove(os.path.join(self.path, name))
            except OSError:
                pass
        try:
            os.rmdir(self.path)
        except OSError:  # something cat-fast did not write is in it: left alone
            pass
        return None


def _normal(record: Dict) -> Dict:
    """`record` as JSON gives it back (tuples as lists), without the options that may differ on a resume."""
    return json.loads(json.dumps({k: v for k, v in record.items() if k not in NEUTRAL_OPTIONS}, default=str))
