"""Reading, validating and pairing counterfactually-augmented data (CAD).

Everything here is plain Python (no tokenizer, no torch): it turns TSV files into a
:class:`CadData` — parallel lists of texts and integer labels, plus the *groups* that tie each
original example to its counterfactual edits.

Formats (see ``cat_fast/data/cad/README.md``):

* sentiment: columns ``Sentiment``, ``Text`` (+ ``batch_id`` in a paired file); labels
  ``Negative`` = 0, ``Positive`` = 1. In a paired file the two rows sharing a ``batch_id`` are a
  counterfactual pair with opposite labels; the row that comes FIRST in the file is the original
  (this holds for the shipped files: they list each original before its edit).
* NLI: columns ``sentence1``, ``sentence2``, ``gold_label``; labels ``entailment`` = 0,
  ``neutral`` = 1, ``contradiction`` = 2. Row k of a revised file (``revised_premise``,
  ``revised_hypothesis``) is an edit of row k // 2 of the originals file (pairing by position,
  never by text).

Text cleaning: HTML line breaks (``<br />``, ``<br/>``, ``<br>``, a stray ``<br /``) in the IMDb reviews are replaced
by a single space and runs of spaces are collapsed (``clean_text=True``, the default); nothing else
is changed.

Files are read through ``datasets.load_dataset("csv", ...)`` with ``delimiter="\\t"``,
``quoting=csv.QUOTE_NONE`` and ``keep_default_na=False`` (so a review reading "NA" stays text), fully
offline, with a private temporary cache directory; a UTF-8 byte-order mark at the start is ignored.

Every problem with the input raises :class:`DataError` (a ``ValueError``, one line) naming the file and what is
wrong (for a file the parser rejects: the line and the parser's reason).

A :class:`CadData` carries a :class:`TaskSpec`: a built-in one (``CadData("sentiment", ...)``) or its own (any label
set); users' own files are read by :func:`cat_fast.data.load_table` (:mod:`cat_fast.data.tables`).
"""
from __future__ import annotations

import atexit
import csv
import math
import os
import random
import re
import shutil
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple, Union

__all__ = [
    "with_label_noise",
    "long_tail",
    "DataError",
    "TaskSpec",
    "TASKS",
    "CadData",
    "PAIRINGS",
    "DATA_DIR",
    "builtin_path",
    "builtin_train_files",
    "clean",
    "read_tsv",
    "load_sentiment",
    "load_nli",
    "load_train",
    "load_eval",
    "load_builtin",
    "few_shot",
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

    def label_id(self, name: str) -> int:
        return self.labels.index(name)


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
# reading

_CACHE_DIR: Optional[str] = None


def _cache_dir() -> str:
    global _CACHE_DIR
    if _CACHE_DIR is None or not os.path.isdir(_CACHE_DIR):
        _CACHE_DIR = tempfile.mkdtemp(prefix="cat_fast_datasets_")
        atexit.register(shutil.rmtree, _CACHE_DIR, True)
    return _CACHE_DIR


_BR = re.compile(r"<br(?:\s*/?\s*>|\s*/)", re.IGNORECASE)  # also one malformed "<br / " in the train set
_SPACES = re.compile(r"[ \t]{2,}")


def clean(text: str) -> str:
    """Replace HTML line breaks by a space and collapse runs of spaces."""
    if "<" in text:
        text = _BR.sub(" ", text)
    return _SPACES.sub(" ", text).strip()


def _one_line(exc: BaseException) -> str:
    """The reason an exception gives, on one line (``Type: message``, newlines as "; ").

    Follows the exception's causes and prefers the parser's own error (pandas, pyarrow, csv, json, a Unicode
    error) to a wrapper such as ``datasets``' "An error occurred while generating the dataset".
    """
    chain: List[BaseException] = []
    e: Optional[BaseException] = exc
    while e is not None and all(e is not c for c in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    said = [c for c in chain if str(c).strip() and type(c).__name__ != "DatasetGenerationError"] or chain
    parser = [c for c in said if isinstance(c, (UnicodeError, csv.Error, ValueError))
              and type(c).__module__.split(".")[0] in ("pandas", "pyarrow", "_csv", "csv", "json", "builtins")]
    pick = (parser or said)[0]
    text = "; ".join(line.strip() for line in str(pick).splitlines() if line.strip())
    return f"{type(pick).__name__}: {text}" if text else type(pick).__name__


def _locate_tsv_problem(path: str, n_columns: int) -> Optional[Tuple[int, str]]:
    """(line, reason) of the first line of a TSV file that is not valid UTF-8 or has more fields than the header."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                return n, f"not valid UTF-8 (byte {raw[e.start]:#04x} at byte {e.start + 1} of the line)"
            fields = line.rstrip("\r\n").count("\t") + 1
            if n > 1 and fields > n_columns and line.strip():
                return n, f"{fields} tab-separated fields, expected {n_columns} (the header's)"
    return None


def read_tsv(path: str, required: Sequence[str]) -> Dict[str, List[str]]:
    """Read a CAD TSV file (header row, tab-separated, no quoting) into columns of strings.

    A UTF-8 byte-order mark at the start of the file is ignored. Raises :class:`DataError` (one line) for a
    missing file, an empty file (no header, or a header without rows), missing columns (naming them and the
    expected ones) and a file the parser rejects (with the parser's reason and the line).
    """
    if not os.path.exists(path):
        raise DataError(f"{path}: file not found")
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, expected a TSV file")
    if os.path.getsize(path) == 0:
        raise DataError(f"{path}: file is empty (expected a header row with columns {', '.join(required)})")
    # check the header ourselves: clearer messages than pandas' and no cache work for a bad file
    with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:
        header_line = f.readline().rstrip("\r\n")
        has_row = any(line.strip() for line in f)
    header = header_line.split("\t")
    missing = [c for c in required if c not in header]
    if missing:
        raise DataError(
            f"{path}: missing column(s) {', '.join(missing)}; expected columns {', '.join(required)}, "
            f"found {', '.join(h for h in header if h) or 'none'}"
        )
    if not has_row:
        raise DataError(f"{path}: file is empty (a header row but no data rows)")

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a parse error is reported once, in the DataError
    try:
        ds = datasets.load_dataset(
            "csv",
            data_files={"data": os.path.abspath(path)},
            delimiter="\t",
            quoting=csv.QUOTE_NONE,
            keep_default_na=False,
            cache_dir=_cache_dir(),
            keep_in_memory=True,
        )["data"]
    except Exception as e:  # pandas parse errors, bad encoding, ...
        where = _locate_tsv_problem(path, len(header))
        at = f"line {where[0]}: {where[1]}; " if where else ""
        raise DataError(f"{path}: cannot be read as a tab-separated file: {at}{_one_line(e)}") from e
    finally:
        datasets.logging.set_verbosity(verbosity)
    if ds.num_rows == 0:
        raise DataError(f"{path}: file is empty (a header row but no data rows)")
    return {c: ["" if v is None else str(v) for v in ds[c]] for c in ds.column_names}


def _labels(path: str, spec: TaskSpec, values: Sequence[str]) -> List[int]:
    ids = []
    for row, v in enumerate(values):
        name = v.strip()
        if name not in spec.labels:
            raise DataError(
                f"{path}: unknown label {v!r} in column {spec.label_column} at row {row + 1} "
                f"(line {row + 2}); allowed labels: {', '.join(spec.labels)}"
            )
        ids.append(spec.labels.index(name))
    return ids


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


# --------------------------------------------------------------------------------------------
# loaders


def _texts(cols: Dict[str, List[str]], names: Sequence[str], clean_text: bool) -> List[List[str]]:
    return [[clean(t) for t in cols[c]] if clean_text else list(cols[c]) for c in names]


def load_sentiment(paths: Sequence[str], paired: Optional[bool] = None, clean_text: bool = True) -> CadData:
    """Sentiment examples from one or more files.

    A file with a ``batch_id`` column is a paired file: each batch_id must occur exactly twice, with
    opposite labels; the first row of a pair (in file order) is the original, the second its edit.
    A file without ``batch_id`` holds unpaired originals. ``paired=True`` requires the column,
    ``paired=False`` ignores it.
    """
    spec = TASKS["sentiment"]
    if isinstance(paths, str):
        paths = [paths]
    text, labels, is_orig, group, sources = [], [], [], [], []
    next_group = 0
    for path in paths:
        required = list(spec.columns) + (["batch_id"] if paired else [])
        cols = read_tsv(path, required)
        ys = _labels(path, spec, cols[spec.label_column])
        (texts,) = _texts(cols, spec.text_columns, clean_text)
        n = len(ys)
        use_pairs = "batch_id" in cols and paired is not False
        if use_pairs:
            rows_of: "OrderedDict[str, List[int]]" = OrderedDict()
            for r, b in enumerate(cols["batch_id"]):
                b = b.strip()
                if not b:
                    raise DataError(f"{path}: empty batch_id at row {r + 1} (line {r + 2})")
                rows_of.setdefault(b, []).append(r)
            gid = {}
            first = set()
            for b, rows in rows_of.items():
                if len(rows) != 2:
                    lines = ", ".join(str(r + 2) for r in rows)
                    raise DataError(
                        f"{path}: pairs do not pair: batch_id {b} has {len(rows)} row(s) (line(s) {lines}); "
                        f"each batch_id must have exactly 2 rows, an original and its edit"
                    )
                if ys[rows[0]] == ys[rows[1]]:
                    raise DataError(
                        f"{path}: pairs do not pair: batch_id {b} (lines {rows[0] + 2} and {rows[1] + 2}) has the same "
                        f"label {spec.labels[ys[rows[0]]]!r} twice; a counterfactual pair needs opposite labels"
                    )
                for r in rows:
                    gid[r] = next_group
                first.add(rows[0])
                next_group += 1
            for r in range(n):
                group.append(gid[r])
                is_orig.append(r in first)
        else:
            for r in range(n):
                group.append(next_group)
                is_orig.append(True)
                next_group += 1
        text += texts
        labels += ys
        sources += [f"{path}:{r + 2}" for r in range(n)]
    return CadData("sentiment", text, None, labels, is_orig, group, sources)


def load_nli(original: str, revised: Sequence[str] = (), clean_text: bool = True) -> CadData:
    """NLI originals plus revised files paired by position (row k of a revised file edits original k // 2)."""
    spec = TASKS["nli"]
    if isinstance(revised, str):
        revised = [revised]
    cols = read_tsv(original, spec.columns)
    ys = _labels(original, spec, cols[spec.label_column])
    s1, s2 = _texts(cols, spec.text_columns, clean_text)
    n = len(ys)
    text, pair, labels = list(s1), list(s2), list(ys)
    is_orig = [True] * n
    group = list(range(n))
    sources = [f"{original}:{r + 2}" for r in range(n)]
    for path in revised:
        rc = read_tsv(path, spec.columns)
        ry = _labels(path, spec, rc[spec.label_column])
        if len(ry) != 2 * n:
            raise DataError(
                f"{path}: pairs do not pair: a revised file must have exactly 2 rows per original "
                f"({2 * n} for the {n} rows of {original}), found {len(ry)}"
            )
        r1, r2 = _texts(rc, spec.text_columns, clean_text)
        text += r1
        pair += r2
        labels += ry
        is_orig += [False] * len(ry)
        group += [k // 2 for k in range(len(ry))]
        sources += [f"{path}:{r + 2}" for r in range(len(ry))]
    return CadData("nli", text, pair, labels, is_orig, group, sources)


def load_train(task: str, paths: Optional[Sequence[str]] = None, clean_text: bool = True) -> CadData:
    """Training data of a task: the built-in CAD train split when ``paths`` is empty.

    sentiment: the files of :func:`load_sentiment`; NLI: first file = originals, further files = revised
    files paired by position.
    """
    spec = _task(task)
    if not paths:
        paths = builtin_train_files(task)
    if spec.name == "sentiment":
        return load_sentiment(paths, clean_text=clean_text)
    return load_nli(paths[0], paths[1:], clean_text=clean_text)


def load_eval(task: str, path: str, clean_text: bool = True) -> CadData:
    """An evaluation file: columns and labels are checked, pairing is not (all rows count as originals)."""
    spec = _task(task)
    if spec.name == "sentiment":
        return load_sentiment([path], paired=False, clean_text=clean_text)
    return load_nli(path, (), clean_text=clean_text)


def load_builtin(task: str, split: str = "train", clean_text: bool = True) -> CadData:
    """The shipped CAD split (originals + edits, grouped)."""
    return load_train(task, builtin_train_files(task, split), clean_text=clean_text)


# --------------------------------------------------------------------------------------------
# few-shot


def few_shot(data: CadData, per_class: int, seed: int = 0, with_edits: bool = True) -> CadData:
    """``per_class`` ORIGINAL examples per class, drawn with ``random.Random(seed)``.

    With ``with_edits`` the edits of the sampled originals come along (their groups are kept whole).
    The result lists groups in data order. Raises :class:`DataError` when a class has fewer originals.
    """
    if per_class < 1:
        raise DataError(f"--per-class must be at least 1, got {per_class}")
    by_class: Dict[int, List[int]] = {c: [] for c in range(data.num_labels)}
    for i in range(len(data)):
        if data.is_orig[i]:
            by_class[data.labels[i]].append(i)
    rng = random.Random(seed)
    chosen = set()
    for c, ix in by_class.items():
        if per_class > len(ix):
            where = data.sources[ix[0]].rsplit(":", 1)[0] if ix and data.sources else "the training data"
            raise DataError(
                f"--per-class {per_class} is larger than class {data.label_names[c]!r}, which has only "
                f"{len(ix)} original example(s) in {where}"
            )
        chosen.update(rng.sample(ix, per_class))
    keep = []
    for ix in data.groups:
        origs = [i for i in ix if data.is_orig[i] and i in chosen]
        if origs:
            keep += ix if with_edits else origs
    keep.sort()
    return data.subset(keep)


def with_label_noise(data: CadData, rate: float, seed: int = 0) -> Tuple[CadData, List[int]]:
    """A copy of `data` with ``round(rate * len(data))`` labels, drawn with ``random.Random(seed)``, each replaced by
    another class drawn uniformly (the noisy-label scenario). Returns (the noisy data, the indices flipped)."""
    if not 0 <= rate < 1:
        raise DataError(f"--label-noise must be in [0, 1), got {rate}")
    if data.num_labels < 2:
        raise DataError("--label-noise needs at least two classes")
    rng = random.Random(seed)
    flipped = sorted(rng.sample(range(len(data)), round(rate * len(data))))
    labels = list(data.labels)
    for i in flipped:
        labels[i] = rng.choice([c for c in range(data.num_labels) if c != labels[i]])
    return replace(data, labels=labels, ids=list(data.ids)), flipped


def long_tail(data: CadData, label: str, fraction: float, seed: int = 0) -> CadData:
    """`data` with only ``ceil(fraction * n)`` of the n examples of class `label` kept (drawn with
    ``random.Random(seed)``; order kept): the long-tail scenario."""
    if label not in data.label_names:
        raise DataError(f"--long-tail: {label!r} is not a label of the data ({', '.join(data.label_names)})")
    if not 0 < fraction <= 1:
        raise DataError(f"--long-tail: the fraction must be in (0, 1], got {fraction}")
    c = data.label_names.index(label)
    members = [i for i in range(len(data)) if data.labels[i] == c]
    keep = set(random.Random(seed).sample(members, math.ceil(fraction * len(members))))
    return data.subset([i for i in range(len(data)) if data.labels[i] != c or i in keep])
