"""Checkpoint folders written atomically: a checkpoint is complete or it does not exist under its name.

`ObjectiveTrainer` writes each ``checkpoint-N`` into a hidden staging folder beside it (``.partial-checkpoint-N``),
adds the objective's state and a manifest (``cat_fast_complete.json``: the step and every file's size) and only then
renames it into place; older checkpoints are rotated away after the new one is in place (renamed to
``.deleting-...`` first, so that an interrupted deletion never leaves a half-deleted ``checkpoint-M``). A resume
takes the newest checkpoint whose manifest matches its files (`last_complete`). An interrupt at any moment therefore
leaves the previous complete checkpoint, at worst with a staging folder that the next save or run removes.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import List, Optional, Tuple

__all__ = ["CheckpointError", "COMPLETE", "PREFIX", "staging_dir", "finish", "rotate", "checkpoint_folders", "complete_checkpoints", "last_complete",
           "is_complete", "remove_leftovers", "remove_checkpoint"]

class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (incomplete, of another run, unreadable)."""


COMPLETE = "cat_fast_complete.json"  # the manifest, written last, inside the staging folder
PREFIX = "checkpoint-"
_NAME = re.compile(r"^checkpoint-(\d+)$")
_LEFTOVER = re.compile(r"^\.(partial|deleting)-checkpoint-\d+")


def staging_dir(run_dir: str, step: int) -> str:
    """The hidden folder in which checkpoint `step` is written (the Trainer writes ``<it>/checkpoint-<step>``)."""
    return os.path.join(run_dir, f".partial-{PREFIX}{step}")


def _manifest(folder: str) -> dict:
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            files[os.path.relpath(path, folder)] = os.path.getsize(path)
    return files


def finish(run_dir: str, step: int) -> str:
    """Seal the staged checkpoint `step` (its manifest, then one rename into ``run_dir/checkpoint-<step>``) and
    return its path. An existing checkpoint of that step is replaced only after the new one is complete."""
    staging = staging_dir(run_dir, step)
    staged = os.path.join(staging, f"{PREFIX}{step}")
    files = _manifest(staged)
    with open(os.path.join(staged, COMPLETE), "w") as f:
        json.dump({"step": step, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    final = os.path.join(run_dir, f"{PREFIX}{step}")
    if os.path.lexists(final):
        remove_checkpoint(final)
    os.replace(staged, final)
    os.rmdir(staging)
    _fsync_dir(run_dir)
    return final


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_complete(folder: str) -> bool:
    """Whether `folder` holds a manifest whose files are all there with their sizes."""
    try:
        with open(os.path.join(folder, COMPLETE)) as f:
            manifest = json.load(f)
        files = manifest["files"]
        return isinstance(files, dict) and all(
            os.path.getsize(os.path.join(folder, name)) == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def checkpoint_folders(run_dir: str, complete: bool = True) -> List[Tuple[int, str]]:
    """(step, path) of every ``checkpoint-N`` folder in `run_dir` (only the complete ones with `complete`), oldest
    first."""
    out = []
    try:
        names = os.listdir(run_dir)
    except OSError:
        return out
    for name in names:
        m = _NAME.match(name)
        path = os.path.join(run_dir, name)
        if m and os.path.isdir(path) and not os.path.islink(path) and (not complete or is_complete(path)):
            out.append((int(m.group(1)), path))
    return sorted(out)


def complete_checkpoints(run_dir: str) -> List[Tuple[int, str]]:
    """(step, path) of every complete checkpoint in `run_dir`, oldest first."""
    return checkpoint_folders(run_dir, complete=True)


def last_complete(run_dir: str) -> Optional[str]:
    """The newest complete checkpoint in `run_dir`, or None."""
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def remove_checkpoint(path: str) -> None:
    """Remove a checkpoint folder: renamed away first (one atomic step), then deleted."""
    parent, name = os.path.split(path.rstrip(os.sep))
    doomed = os.path.join(parent, f".deleting-{name}-{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def rotate(run_dir: str, keep: Optional[int]) -> None:
    """Keep the newest `keep` complete checkpoints (None or 0: all); older complete ones are removed."""
    if not keep:
        return
    found = complete_checkpoints(run_dir)
    for _, path in found[:-keep]:
        remove_checkpoint(path)


def remove_leftovers(run_dir: str) -> None:
    """Remove the staging and half-deleted folders an interrupted save or rotation left in `run_dir`."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return
    for name in names:
        path = os.path.join(run_dir, name)
        if _LEFTOVER.match(name) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
