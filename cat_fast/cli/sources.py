"""Where ``cat-fast`` reads its examples: a built-in CAD task (``--task sentiment|nli``, the files and formats of the
CAD release) or the user's own files (``--text-column`` / ``--label-column`` [/ ``--text-pair-column`` /
``--group-column`` / ``--id-column`` / ``--labels``]: CSV, TSV, JSON Lines, a ``save_to_disk`` directory or a local
Hugging Face dataset)."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .common import CliError

__all__ = ["Source", "COLUMN_OPTIONS"]

# option dest -> keyword of cat_fast.data.load_table
COLUMN_OPTIONS = {"text_column": "text_column", "text_pair_column": "text_pair_column",
                  "label_column": "label_column", "group_column": "group_column", "id_column": "id_column"}


class Source:
    """The examples of one run: ``task`` (a CAD preset) or ``columns`` (the user's own files)."""

    def __init__(self, task: Optional[str], columns: Dict[str, Optional[str]], labels: Optional[Sequence[str]]):
        self.task = task
        self.columns = {k: v for k, v in columns.items() if v}
        self.labels = tuple(labels) if labels else None
        if self.columns and ("text_column" not in self.columns or "label_column" not in self.columns):
            raise CliError("your own data needs --text-column and --label-column (and --text-pair-column for text "
                           "pairs, --group-column for counterfactual groups)")
        if not self.columns and not task:
            raise CliError("say what to train on: --task sentiment|nli (the built-in CAD data or CAD-format files), "
                           "or --train FILE with --text-column and --label-column")

    @classmethod
    def from_args(cls, args, meta: Optional[Dict] = None) -> "Source":
        columns = {k: getattr(args, k, None) for k in COLUMN_OPTIONS}
        labels = getattr(args, "labels", None)
        task = getattr(args, "task", None)
        if meta and not any(columns.values()) and not task:  # `cat-fast eval`: what the checkpoint was trained on
            task = meta.get("task") if meta.get("task") in ("sentiment", "nli") else None
            columns = dict(meta.get("columns") or {})
            labels = labels or meta.get("labels")
        return cls(None if columns and any(columns.values()) else task, columns, labels)

    @property
    def custom(self) -> bool:
        return bool(self.columns)

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

    def read(self, path: Optional[str], labels: Optional[Sequence[str]] = None, split: Optional[str] = None):
        """An evaluation / dev file (pairing not required); ``None``: the shipped HANS-style set (``--eval hans``)."""
        from .. import data as D

        if path is None:
            return D.load_hans()

        if not self.custom:
            return D.load_eval(self.task, path)
        kwargs = {COLUMN_OPTIONS[k]: v for k, v in self.columns.items()}
        return D.load_table(path, labels=labels or self.labels, **kwargs)

    def read_train(self, paths: Optional[List[str]]):
        from .. import data as D

        if not self.custom:
            return D.load_train(self.task, paths)
        if not paths:
            raise CliError("--train FILE is needed with --text-column / --label-column")
        if len(paths) != 1:
            raise CliError(f"--train takes one file or directory with --text-column, got {len(paths)}")
        kwargs = {COLUMN_OPTIONS[k]: v for k, v in self.columns.items()}
        return D.load_table(paths[0], labels=self.labels, **kwargs)

    def builtin_dev(self):
        """The built-in dev set (CAD presets only), else None."""
        from .. import data as D

        return None if self.custom else D.load_builtin(self.task, "dev")

    def meta(self, train) -> Dict:
        return {"task": self.name, "columns": dict(self.columns), "labels": list(self.label_names(train))}
