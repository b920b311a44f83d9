"""Shared pieces of the ``cat-fast`` commands: one-line errors, argument types, the atomic output directory, devices
and checkpoints. Scoring lives in `scoring`, the training curves in `plot` (their names are still found here)."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["CliError", "TrainingFailed", "PRESETS", "MARKER", "mark_output", "Parser", "fail", "AtomicDir",
           "CHECKPOINT_META", "DATA_MODES", "parse_evals", "get_device", "setup_device", "seed_everything",
           "write_json", "save_checkpoint", "int_at_least", "positive_int", "nonneg_int"]

_MOVED = {"autocast": "scoring", "to_device": "scoring", "encode_batches": "scoring", "predict_logits": "scoring",
          "predict": "scoring", "predict_probs": "scoring", "accuracy": "scoring", "confusion": "scoring",
          "EvalSet": "scoring", "plot": "plot"}


def __getattr__(name):
    """The scoring and plotting helpers under their former address (`scoring`, `plot`)."""
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(f".{_MOVED[name]}", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


DATA_MODES = ("orig", "orig+edits")


CHECKPOINT_META = "cat_fast.json"


class CliError(Exception):
    """A user error reported as one line with exit status 2."""

    exit_code = 2


class TrainingFailed(CliError):
    """A run that cannot go on (its loss became non-finite): one line, exit status 3."""

    exit_code = 3


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``cat-fast: error: ...``), exit status 2."""

    def error(self, message):
        fail(message)


def fail(message, code: int = 2) -> None:
    msg = " ".join(str(message).split())
    sys.stderr.write(f"cat-fast: error: {msg}\n")
    sys.stderr.flush()
    raise SystemExit(code)


# ------------------------------------------------------------------------------------------------
# argument parsing


def int_at_least(low: int, what: str):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            v = low - 1
        if v < low:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {s!r}")
        return v

    return parse


positive_int = int_at_least(1, "positive")


nonneg_int = int_at_least(0, "non-negative")


EVAL_RE = re.compile(r"^([A-Za-z0-9_.\-]+)=(.+)$")


PRESETS = ("hans",)  # --eval NAME without a file: a challenge set shipped with cat_fast


def parse_evals(specs: Sequence[str], reserved: Sequence[str] = ()) -> List[Tuple[str, str]]:
    out, seen = [], set(reserved)
    for s in specs:
        if s in PRESETS and s not in seen:
            seen.add(s)
            out.append((s, None))
            continue
        m = EVAL_RE.match(s)
        if not m:
            raise CliError(f"--eval expects NAME=FILE (NAME of letters, digits, '_', '-', '.'), got {s!r}")
        name, path = m.group(1), m.group(2)
        if name in seen:
            raise CliError(f"--eval name {name!r} is used twice (or is reserved: {', '.join(reserved) or 'none'})")
        seen.add(name)
        out.append((name, path))
    return out


# ------------------------------------------------------------------------------------------------
# output directory, written atomically


MARKER = ".cat-fast"  # in every directory cat-fast writes: what --overwrite may replace


def mark_output(directory: str) -> None:
    with open(os.path.join(directory, MARKER), "w") as f:
        f.write("written by cat-fast; `cat-fast ... --overwrite` may replace this directory\n")


def _within(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def _resolve_out(path: str) -> str:
    """The absolute output path, a symbolic link to a directory followed; a dangling link is refused."""
    path = os.path.abspath(path)
    if os.path.islink(path):
        target = os.path.realpath(path)
        if not os.path.exists(target):
            raise CliError(f"--out {path} is a symbolic link to {target}, which does not exist: create the target "
                           "directory or choose another --out")
        return target
    return path


class AtomicDir:
    """Write into a temporary sibling of ``path``; ``commit()`` renames it into place.

    On an exception (or KeyboardInterrupt) before commit, the temporary directory and any parent
    directories created for it are removed.
    """

    def __init__(self, path: str, overwrite: bool):
        self.path = _resolve_out(path)
        self.overwrite = overwrite
        self.tmp: Optional[str] = None
        self.created: List[str] = []

    @staticmethod
    def check(path: str, overwrite: bool, inputs: Sequence[str] = ()) -> str:
        """An existing non-empty `path` is replaced only with `overwrite`, only when cat-fast wrote it (its marker
        file), and never when it is or holds the working directory or one of the run's `inputs`. Returns the path
        written: a symbolic link to a directory is followed (the link stays, its target is replaced)."""
        path = _resolve_out(path)
        if os.path.exists(path) and not os.path.isdir(path):
            raise CliError(f"--out {path} exists and is not a directory")
        if not (os.path.isdir(path) and os.listdir(path)):
            return path
        if not overwrite:
            raise CliError(f"--out {path} exists and is not empty; pass --overwrite to replace it")
        real = os.path.realpath(path)
        from .sources import split_of  # DIR@SPLIT (a split of a dataset folder) is DIR on the file system

        inputs = [split_of(str(p))[0] for p in inputs if p]
        for inside in [os.getcwd()] + [p for p in inputs if os.path.exists(p)]:
            if _within(os.path.realpath(inside), real):
                what = "the working directory" if inside == os.getcwd() else f"the input {inside}"
                raise CliError(f"--out {path} holds {what}; --overwrite replaces only a directory cat-fast wrote, "
                               "choose another --out")
        if not os.path.isfile(os.path.join(path, MARKER)):
            raise CliError(f"--out {path} was not written by cat-fast (no {MARKER} file in it); --overwrite "
                           "replaces only a directory cat-fast wrote, choose another --out or remove it yourself")
        return path

    def __enter__(self) -> str:
        parent = os.path.dirname(self.path)
        missing = []
        d = parent
        while d and not os.path.isdir(d):
            missing.append(d)
            d = os.path.dirname(d)
        try:
            os.makedirs(parent, exist_ok=True)
            self.created = missing  # deepest first
            self.tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(self.path)}.tmp-", dir=parent)
        except OSError as e:
            raise CliError(f"cannot create the output directory {self.path}: {e.strerror or e}") from e
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.tmp, 0o777 & ~umask)  # mkdtemp makes 0700; give the final DIR ordinary permissions
        mark_output(self.tmp)
        return self.tmp

    def commit(self) -> None:
        old = None
        if os.path.isdir(self.path):
            if os.listdir(self.path):
                old = tempfile.mkdtemp(prefix=f".{os.path.basename(self.path)}.old-", dir=os.path.dirname(self.path))
                os.rmdir(old)
                os.replace(self.path, old)
            else:
                os.rmdir(self.path)
        os.replace(self.tmp, self.path)
        self.tmp = None
        if old:
            shutil.rmtree(old, ignore_errors=True)

    def __exit__(self, exc_type, exc, tb):
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
            for d in self.created:
                try:
                    os.rmdir(d)
                except OSError:
                    break
        return False


# ------------------------------------------------------------------------------------------------
# helpers


def get_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device is available (use --device cpu or auto)")
    return torch.device(name)


def setup_device(device) -> None:
    import torch

    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's generators (every device): `transformers.set_seed`."""
    from transformers import set_seed

    set_seed(seed % 2**32)  # numpy's range (seed + rank under torchrun may pass it)


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def save_checkpoint(directory: str, model, tokenizer, meta: Dict) -> None:
    from ..models.pretrained import quiet_transformers

    with quiet_transformers():
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    write_json(os.path.join(directory, CHECKPOINT_META), meta)
