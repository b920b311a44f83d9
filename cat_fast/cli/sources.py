"""Where ``cat-fast`` reads its examples: a built-in CAD task (``--task sentiment|nli``, the files and formats of the
CAD release) or the user's own files (CSV, TSV, JSON Lines, a JSON array, a ``save_to_disk`` directory or a local
Hugging Face dataset).

The columns of the user's files: ``--text-column`` / ``--label-column`` [/ ``--text-pair-column`` /
``--group-column`` / ``--id-column`` / ``--labels``]; those not given are found by name in each file, by the
conventions of ``run_glue.py`` and the datasets hub (`cat_fast.data.find_columns`), and the choice is printed on
stderr. A split of a dataset folder: ``PATH@SPLIT`` wherever a path is given (``--train``, ``--dev``, ``--eval``,
``--meta-data``, ``--samples``); without it the training data is the folder's only split, else ``train``, and an
evaluation set its only split, else ``validation``.

The shipped CAD data has names, usable wherever a path is: ``cad:TASK/SPLIT`` (``cad:nli/train``,
``cad:sentiment/dev``: what ``--task`` reads by default) and ``cad:TASK/SPLIT/KIND`` for one of its files
(``cad:nli/train/original``: the NLI originals; `builtin_files`).
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from .common import CliError

__all__ = ["Source", "COLUMN_OPTIONS", "split_of"]

# option dest -> keyword of cat_fast.data.load_table
COLUMN_OPTIONS = {"text_column": "text_column", "text_pair_column": "text_pair_column",
                  "label_column": "label_column", "group_column": "group_column", "id_column": "id_column"}
_CHOOSE_COLUMNS = "--text-column / --text-pair-column / --label-column to choose"


BUILTIN_PREFIX = "cad:"
_BUILTIN_FORMS = ("cad:TASK/SPLIT or cad:TASK/SPLIT/KIND (TASK sentiment|nli, SPLIT train|dev; KIND sentiment "
                  "paired|orig|new, nli original|revised_premise|revised_hypothesis), e.g. cad:nli/train/original")


def builtin_files(name: str) -> Tuple[str, List[str]]:
    """A shipped data name -> ``(task, files)``: ``cad:TASK/SPLIT`` is the task's built-in split (the files that
    ``--task TASK`` reads by default), ``cad:TASK/SPLIT/KIND`` one file of it (`cat_fast.data.builtin_path`)."""
    from .. import data as D

    parts = name[len(BUILTIN_PREFIX):].split("/")
    if len(parts) not in (2, 3) or parts[0] not in D.TASKS or parts[1] not in ("train", "dev"):
        raise CliError(f"{name}: expected a shipped data name {_BUILTIN_FORMS}")
    task, split = parts[0], parts[1]
    try:
        files = [D.builtin_path(task, split, parts[2])] if len(parts) == 3 else D.builtin_train_files(task, split)
    except D.DataError as error:
        raise CliError(f"{name}: {error}") from None
    return task, files


def split_of(path: str) -> Tuple[str, Optional[str]]:
    """``PATH@SPLIT`` -> ``(PATH, SPLIT)`` where PATH exists (or is a hub dataset name) and ``PATH@SPLIT`` does
    not; else ``(path, None)``."""
    if "@" not in path or os.path.exists(path):
        return path, None
    head, _, split = path.rpartition("@")
    from ..data.readers import is_hub_name

    if head and not os.path.exists(head) and is_hub_name(head):
        return head, split or None  # a cached hub dataset's split
    if not head or not os.path.exists(head):
        return path, None
    if not split:
        raise CliError(f"{path}: expected a split name after '@' (PATH@SPLIT, e.g. {head}@validation)")
    if not os.path.isdir(head):
        raise CliError(f"{path}: {head} is a file; PATH@SPLIT chooses a split of a dataset folder")
    return head, split


class Source:
    """The examples of one run: ``task`` (a CAD preset), else the user's own files (``columns``: those given)."""

    def __init__(self, task: Optional[str], columns: Dict[str, Optional[str]], labels: Optional[Sequence[str]]):
        self.task = task
        self.columns = {k: v for k, v in columns.items() if v}
        self.labels = tuple(labels) if labels else None
        if "text_pair_column" in self.columns and "text_column" not in self.columns:
            raise CliError("--text-pair-column needs --text-column (the first text of the pair); or give neither "
                           "and the text columns are found by name")
        self._said: set = set()  # the column choices already printed
        self._first: Optional[Tuple[str, bool]] = None  # the first file read and whether it held text pairs

    @classmethod
    def from_args(cls, args, meta: Optional[Dict] = None) -> "Source":
        columns = {k: getattr(args, k, None) for k in COLUMN_OPTIONS}
        labels = getattr(args, "labels", None)
        task = getattr(args, "task", None)
        if meta and not any(columns.values()) and not task:  # `cat-fast eval`: what the checkpoint was trained on
            task = meta.get("task") if meta.get("task") in ("sentiment", "nli") else None
            columns = dict(meta.get("columns") or {})
            labels = labels or meta.get("labels")
        if not task and not meta and hasattr(args, "train") and not args.train:
            raise CliError("say what to train on: --task sentiment|nli (the built-in CAD data or CAD-format files), "
                           "or --train FILE (its text and label columns found by name, or --text-column and "
                           "--label-column)")
        return cls(None if columns and any(columns.values()) else task, columns, labels)

    @property
    def custom(self) -> bool:
        return not self.task

    @property
    def name(self) -> str:
        return self.task or "custom"

    def label_names(self, train=None) -> Tuple[str, ...]:
        if not self.custom:
            from .. import data as D

            return D.TASKS[self.task].labels
        if self.labels:
            return self.labels
        if train is None:
            raise CliError("--labels is needed to read these files (or a checkpoint that names its labels)")
        return tuple(train.label_names)

    def read(self, path: Optional[str], labels: Optional[Sequence[str]] = None):
        """An evaluation / dev file (pairing not required; a dataset folder's only split, else ``validation``);
        ``None``: the shipped HANS-style set (``--eval hans``)."""
        from .. import data as D

        if path is None:
            return D.load_hans()
        files = self._files([path])
        if not self.custom:  # a whole shipped split is read as --task reads it (pairs checked), a file as one
            return D.load_train(self.task, files) if len(files) > 1 else D.load_eval(self.task, files[0])
        return self._load(self._one(path, files), labels or self.labels, "validation")

    def read_train(self, paths: Optional[List[str]]):
        from .. import data as D

        if not self.custom:
            return D.load_train(self.task, self._files(paths) if paths else paths)
        if not paths:
            raise CliError("--train FILE is needed for your own data (--text-column / --label-column name its "
                           "columns, else they are found by name)")
        if len(paths) != 1:
            raise CliError(f"--train takes one file or directory for your own data, got {len(paths)}")
        return self._load(self._one(paths[0], self._files(paths)), self.labels, "train")

    def _files(self, paths: Sequence[str]) -> List[str]:
        """`paths` with each shipped data name (``cad:...``, `builtin_files`) replaced by its files."""
        out = []
        for path in paths:
            if not path.startswith(BUILTIN_PREFIX):
                out.append(path)
                continue
            task, files = builtin_files(path)
            if not self.custom and task != self.task:
                raise CliError(f"{path}: {task} data, but this run's --task is {self.task}")
            out.extend(files)
        return out

    @staticmethod
    def _one(name: str, files: List[str]) -> str:
        if len(files) != 1:
            raise CliError(f"{name}: {len(files)} files, and your own data is read from one; name one with "
                           f"cad:TASK/SPLIT/KIND, e.g. {name}/original (or give --task for the CAD pairing)")
        return files[0]

    def _load(self, arg: str, labels: Optional[Sequence[str]], default_split: str):
        from ..data import ChoiceError, load_table

        path, split = split_of(arg)
        kwargs = {COLUMN_OPTIONS[k]: v for k, v in self.columns.items()}
        how = {"split": f"{path}@SPLIT", "text_column": "--text-column NAME",
               "text_pair_column": "--text-pair-column NAME", "label_column": "--label-column NAME"}
        try:
            data = load_table(path, labels=labels, split=split, default_split=default_split, **kwargs)
        except ChoiceError as error:
            raise CliError(error.advise(how)) from error
        self._found(arg, data)
        return data

    def _found(self, arg: str, data) -> None:
        """Print the columns found by name (once per choice); refuse a file whose texts are not shaped as the first
        file's (text pairs against single texts)."""
        cols = data.spec.text_columns
        pairs = len(cols) > 1
        if "text_column" in self.columns and "label_column" in self.columns:
            return  # nothing found by name: every file has the same columns
        said = f"text={cols[0]}" + (f", text pair={cols[1]}" if pairs else "") + f", label={data.spec.label_column}"
        if said not in self._said:
            self._said.add(said)
            sys.stderr.write(f"cat-fast: columns: {said} (found by name in {arg}; {_CHOOSE_COLUMNS})\n")
        if self._first is None:
            self._first = (arg, pairs)
        elif self._first[1] != pairs:
            shape = {True: "text pairs", False: "single texts"}
            raise CliError(f"{arg}: {shape[pairs]} found by name ({said}), but {self._first[0]} has "
                           f"{shape[self._first[1]]}; {_CHOOSE_COLUMNS}")

    def builtin_dev(self):
        """The built-in dev set (CAD presets only), else None."""
        from .. import data as D

        return None if self.custom else D.load_builtin(self.task, "dev")

    def meta(self, train) -> Dict:
        return {"task": self.name, "columns": dict(self.columns), "labels": list(self.label_names(train))}
