"""The readers of the CAD TSV files, built-in or given: each returns a :class:`~cat_fast.data.core.CadData`.

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

Every problem with the input raises :class:`~cat_fast.data.core.DataError` (a ``ValueError``, one line) naming the
file and what is wrong (for a file the parser rejects: the line and the parser's reason).
"""
from __future__ import annotations

import csv
import os
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

from .core import TASKS, CadData, DataError, TaskSpec, _task, builtin_train_files
from .text_files import cache_dir, clean, locate_tsv_problem, one_line

__all__ = ["read_tsv", "load_sentiment", "load_nli", "load_train", "load_eval", "load_builtin"]


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
            cache_dir=cache_dir(),
            keep_in_memory=True,
        )["data"]
    except Exception as e:  # pandas parse errors, bad encoding, ...
        where = locate_tsv_problem(path, len(header))
        at = f"line {where[0]}: {where[1]}; " if where else ""
        raise DataError(f"{path}: cannot be read as a tab-separated file: {at}{one_line(e)}") from e
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
