"""The data model of counterfactually-augmented data (CAD): :class:`CadData` — parallel lists of texts and integer
labels, plus the *groups* that tie each original example to its counterfactual edits, and the pairing rules — with
the :class:`TaskSpec` of its task and :class:`DataError`, which every problem with the input raises (one line).

Everything here is plain Python (no tokenizer, no torch). A :class:`CadData` carries a :class:`TaskSpec`: a built-in
one (``CadData("sentiment", ...)``, the shipped files found by :func:`builtin_path`) or its own (any label set).
The CAD TSV files and their formats: :mod:`cat_fast.data.cad_readers`; users' own files:
:func:`cat_fast.data.load_table` (:mod:`cat_fast.data.tables`); training sets drawn from a :class:`CadData`:
:mod:`cat_fast.data.sampling`.
"""
from __future__ import annotations

import os
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

from .text_files import cache_dir as _cache_dir  # noqa: F401  (the readers of users' tables)
from .text_files import clean  # noqa: F401  (users' tables)
from .text_files import one_line as _one_line  # noqa: F401  (the readers of users' tables)

__all__ = [
    "DataError",
    "TaskSpec",
    "TASKS",
    "CadData",
    "PAIRINGS",
    "DATA_DIR",
    "builtin_path",
    "builtin_train_files",
    "require_classes",
]

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cad")


class DataError(ValueError):
    """Bad input data: a missing or empty file, missing columns, an unknown label, pairs that do not pair."""


@dataclass(frozen=True)
class TaskSpec:
    """What a task's examples look like: its name, label column, text column(s) and label names (id = position).

    The built-in tasks are in :data:`TASKS`; user data (:func:`cat_fast.data.load_table`) carries its own, e.g.
    ``TaskSpec("custom", "label", ("premise", "hypothesis"), ("entailment", "neutral", "contradiction"))``.
    """

    name: str
    label_column: str
    text_columns: Tuple[str, ...]
    labels: Tuple[str, ...]

    def __post_init__(self):
        object.__setattr__(self, "text_columns", tuple(self.text_columns))
        object.__setattr__(self, "labels", tuple(self.labels))
        if not self.labels:
            raise DataError(f"task {self.name!r}: no labels; expected at least one label name")
        if not all(isinstance(n, str) for n in self.labels):
            raise DataError(f"task {self.name!r}: label names must be strings, got {list(self.labels)!r}")
        dup = sorted({n for n in self.labels if self.labels.count(n) > 1})
        if dup:
            raise DataError(f"task {self.name!r}: duplicate label name(s) {', '.join(map(repr, dup))}")
        if not 1 <= len(self.text_columns) <= 2:
            raise DataError(f"task {self.name!r}: expected one text column or two (a text pair), "
                            f"got {list(self.text_columns)!r}")

    @property
    def columns(self) -> Tuple[str, ...]:
        return (self.label_column,) + self.text_columns if self.name == "sentiment" else self.text_columns + (self.label_column,)

    @property
    def num_labels(self) -> int:
        return len(self.labels)


TASKS: Dict[str, TaskSpec] = {
    "sentiment": TaskSpec("sentiment", "Sentiment", ("Text",), ("Negative", "Positive")),
    "nli": TaskSpec("nli", "gold_label", ("sentence1", "sentence2"), ("entailment", "neutral", "contradiction")),
}


def _task(task: str) -> TaskSpec:
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}; expected one of {sorted(TASKS)}")
    return TASKS[task]


# --------------------------------------------------------------------------------------------
# built-in files

_BUILTIN = {
    # (task, split, kind) -> path relative to DATA_DIR
    ("sentiment", "train", "paired"): "sentiment/combined/paired/train_paired.tsv",
    ("sentiment", "dev", "paired"): "sentiment/combined/paired/dev_paired.tsv",
    ("sentiment", "train", "orig"): "sentiment/orig/train.tsv",
    ("sentiment", "dev", "orig"): "sentiment/orig/dev.tsv",
    ("sentiment", "train", "new"): "sentiment/new/train.tsv",
    ("sentiment", "dev", "new"): "sentiment/new/dev.tsv",
    ("nli", "train", "original"): "NLI/original/train.tsv",
    ("nli", "dev", "original"): "NLI/original/dev.tsv",
    ("nli", "train", "revised_premise"): "NLI/revised_premise/train.tsv",
    ("nli", "dev", "revised_premise"): "NLI/revised_premise/dev.tsv",
    ("nli", "train", "revised_hypothesis"): "NLI/revised_hypothesis/train.tsv",
    ("nli", "dev", "revised_hypothesis"): "NLI/revised_hypothesis/dev.tsv",
}
_KIND_ALIASES = {("nli", "orig"): "original", ("nli", "new"): None, ("sentiment", "original"): "orig"}


def builtin_path(task: str, split: str, kind: str) -> str:
    """Path of a shipped CAD file.

    ``task``: ``sentiment`` | ``nli``; ``split``: ``train`` | ``dev``; ``kind``: sentiment
    ``paired`` | ``orig`` | ``new``; NLI ``original`` | ``revised_premise`` | ``revised_hypothesis``.
    """
    _task(task)
    kind = _KIND_ALIASES.get((task, kind), kind) or kind
    key = (task, split, kind)
    if key not in _BUILTIN:
        kinds = sorted({k for (t, s, k) in _BUILTIN if t == task})
        raise DataError(f"no built-in {task} file for split={split!r}, kind={kind!r}; splits: train, dev; kinds: {kinds}")
    return os.path.join(DATA_DIR, _BUILTIN[key])


def builtin_train_files(task: str, split: str = "train") -> List[str]:
    """The files ``load_train`` reads for the built-in data of a task (originals first)."""
    if _task(task).name == "sentiment":
        return [builtin_path(task, split, "paired")]
    return [builtin_path(task, split, k) for k in ("original", "revised_premise", "revised_hypothesis")]


# --------------------------------------------------------------------------------------------
# the data container


PAIRINGS = ("original", "all")


@dataclass
class CadData:
    """Examples of one task, with their counterfactual groups.

    ``task`` is a built-in task name (``"sentiment"``, ``"nli"``: its :class:`TaskSpec` comes from :data:`TASKS`)
    or a :class:`TaskSpec` of its own (user data, any label set); ``spec`` may also be given by keyword, and
    ``self.task`` is always the name, ``self.spec`` the spec.

    ``groups[g]`` lists the example indices of group g, the original first, then its edits. An
    example without counterfactuals is a group of one. ``partners[i]`` lists the counterfactuals of
    example i whose label differs from i's, as chosen by ``pairing``:

    * ``"original"`` (CAD, the default): an edit's only candidate is its original; an original's candidates are
      its edits (two edits of one original are not partners).
    * ``"all"`` (user groups, :func:`cat_fast.data.load_table`): any two members of a group with different
      labels are partners of each other.

    ``ids``: one example id per example (default: ``"0"``, ``"1"``, ... in order), kept through :meth:`subset`
    (to align per-example files such as bias scores). ``sources``: ``"file:line"`` of each example, for
    messages. ``skipped`` / ``skipped_where``: rows the loader skipped (blank text) and where the first few were;
    a subset keeps them (they describe the source it came from).
    """

    task: Union[str, TaskSpec]
    text: List[str]
    text_pair: Optional[List[str]]
    labels: List[int]
    is_orig: List[bool]
    group: List[int]
    sources: List[str] = field(default_factory=list)  # "file:line" of each example, for messages
    ids: List[str] = field(default_factory=list)
    spec: Optional[TaskSpec] = None
    pairing: str = "original"
    skipped: int = 0
    skipped_where: List[str] = field(default_factory=list)

    def __post_init__(self):
        if isinstance(self.task, TaskSpec):
            if self.spec is not None and self.spec != self.task:
                raise DataError(f"CadData: task {self.task.name!r} and spec {self.spec.name!r} disagree; give one")
            self.spec, self.task = self.task, self.task.name
        elif self.spec is None:
            self.spec = _task(self.task)
        if self.pairing not in PAIRINGS:
            raise DataError(f"CadData: unknown pairing {self.pairing!r}; expected one of {', '.join(PAIRINGS)}")
        n = len(self.text)
        assert len(self.labels) == n and len(self.is_orig) == n and len(self.group) == n
        assert self.text_pair is None or len(self.text_pair) == n
        assert not self.sources or len(self.sources) == n
        if not self.ids:
            self.ids = [str(i) for i in range(n)]
        assert len(self.ids) == n
        k = self.spec.num_labels
        bad = next((i for i, y in enumerate(self.labels) if not 0 <= y < k), None)
        if bad is not None:
            where = f" ({self.sources[bad]})" if self.sources else ""
            raise DataError(f"CadData: label id {self.labels[bad]} of example {bad}{where} is not in 0..{k - 1} "
                            f"(labels {', '.join(self.spec.labels)})")
        groups: "OrderedDict[int, List[int]]" = OrderedDict()
        for i, g in enumerate(self.group):
            groups.setdefault(g, []).append(i)
        # original first inside each group
        self.groups: List[List[int]] = [sorted(ix, key=lambda i: (not self.is_orig[i], i)) for ix in groups.values()]
        self.partners: List[List[int]] = [[] for _ in range(n)]
        for ix in self.groups:
            if len(ix) < 2:
                continue
            if self.pairing == "all":
                for i in ix:
                    self.partners[i] = [j for j in ix if j != i and self.labels[j] != self.labels[i]]
                continue
            origs = [i for i in ix if self.is_orig[i]]
            for o in origs:
                for e in ix:
                    if not self.is_orig[e] and self.labels[e] != self.labels[o]:
                        self.partners[o].append(e)
                        self.partners[e].append(o)

    # -- basic facts
    def __len__(self) -> int:
        return len(self.text)

    @property
    def label_names(self) -> Tuple[str, ...]:
        return self.spec.labels

    @property
    def num_labels(self) -> int:
        return self.spec.num_labels

    @property
    def has_pairs(self) -> bool:
        return any(self.partners)

    @property
    def n_orig(self) -> int:
        return sum(self.is_orig)

    def class_counts(self, originals_only: bool = False) -> Dict[str, int]:
        counts = {name: 0 for name in self.spec.labels}
        for y, o in zip(self.labels, self.is_orig):
            if o or not originals_only:
                counts[self.spec.labels[y]] += 1
        return counts

    # -- selection
    def subset(self, indices: Sequence[int]) -> "CadData":
        """A new CadData holding ``indices`` (in that order); groups and partners are rebuilt."""
        indices = list(indices)
        return CadData(
            task=self.task,
            text=[self.text[i] for i in indices],
            text_pair=None if self.text_pair is None else [self.text_pair[i] for i in indices],
            labels=[self.labels[i] for i in indices],
            is_orig=[self.is_orig[i] for i in indices],
            group=[self.group[i] for i in indices],
            sources=[self.sources[i] for i in indices] if self.sources else [],
            ids=[self.ids[i] for i in indices],
            spec=self.spec,
            pairing=self.pairing,
            skipped=self.skipped,
            skipped_where=list(self.skipped_where),
        )

    def originals(self) -> "CadData":
        return self.subset([i for i in range(len(self)) if self.is_orig[i]])

    def edits(self) -> "CadData":
        return self.subset([i for i in range(len(self)) if not self.is_orig[i]])

    # -- pairs for gradient supervision
    def choose_partners(self, seed: int = 0) -> List[int]:
        """One counterfactual partner per example (dataset index, or -1 when it has none).

        An edit gets its original; an original gets one of its differently-labelled edits, drawn with
        ``random.Random(seed)`` (sentiment originals have exactly one edit). With ``pairing="all"`` every example
        draws among all its partners (:attr:`partners`) the same way.
        """
        rng = random.Random(seed)
        out = []
        for i, cands in enumerate(self.partners):
            if not cands:
                out.append(-1)
            elif len(cands) == 1:
                out.append(cands[0])
            else:
                out.append(cands[rng.randrange(len(cands))])
        return out

    def describe(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in self.class_counts().items())
        out = (f"{self.task}: {len(self)} examples ({self.n_orig} originals, {len(self) - self.n_orig} edits; {counts}), "
               f"{len(self.groups)} groups")
        if self.skipped:
            more = ", ..." if self.skipped > len(self.skipped_where) else ""
            out += f"; {self.skipped} row(s) skipped for empty text ({', '.join(self.skipped_where)}{more})"
        return out


def require_classes(data: CadData, what: str = "the training data") -> None:
    """:class:`DataError` unless `data` has examples of at least two classes: a classifier needs two (one class
    would give a one-label head, which Hugging Face models train as a regression)."""
    seen = set(data.labels)
    present = [name for c, name in enumerate(data.label_names) if c in seen]
    if len(present) >= 2:
        return
    if not present:
        raise DataError(f"{what} has no examples; a classifier needs examples of at least two classes")
    of = "" if len(data.label_names) == 1 else f" of {', '.join(map(repr, data.label_names))}"
    raise DataError(f"{what} has one class ({present[0]!r}{of}); a classifier needs at least two")
