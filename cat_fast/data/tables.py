"""Your own data: :func:`load_table` reads a CSV, TSV or JSON Lines file, or a Hugging Face dataset folder, into a
:class:`~cat_fast.data.core.CadData` with its own label set (a :class:`~cat_fast.data.core.TaskSpec` of its own).

Typical use::

    from cat_fast import data
    train = data.load_table("train.csv", text_column="review", label_column="label", group_column="pair_id")
    print(train.describe(), train.label_names, train.skipped)   # label names for the checkpoint's id2label
    ds = data.TokenizedData(train, tokenizer, max_length=128)    # then make_batches / Collator as for CAD data

What ``path`` is decides the format: ``.csv`` (comma, standard quoting: fields with commas, quotes or newlines in
double quotes); ``.tsv`` / ``.tab`` / ``.txt`` (tab, no quoting: the CAD files' convention); ``.jsonl`` / ``.json``
(JSON Lines: one object per line); a folder written by ``datasets.Dataset.save_to_disk`` or
``DatasetDict.save_to_disk`` (split ``"train"`` unless ``split=``); any other folder goes to
``datasets.load_dataset(path)`` offline (a folder of data files). Every CSV/TSV cell is text ("NA" stays "NA"); a
UTF-8 byte-order mark is ignored; blank lines are not rows.

Rows whose text (or pair text) is empty or only whitespace are skipped and counted (``CadData.skipped``,
``CadData.skipped_where``). Labels: the names in ``labels=``, else every distinct value (integers in numeric order,
other strings alphabetically; a ``ClassLabel`` column keeps its own names and order). Groups (``group_column``):
rows sharing an id are counterfactuals of each other, the first in file order is the original, and any two members
with different labels are partners (``pairing="all"``); a row with an empty group id is a group of its own.
Every problem raises :class:`~cat_fast.data.core.DataError` on one line: the file, the line (CSV/TSV: the header is
line 1; JSONL: the line; a dataset: the 0-based row), what is wrong and what was expected.
"""
from __future__ import annotations

import csv
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from .core import CadData, DataError, TaskSpec, _cache_dir, _one_line, clean

__all__ = ["load_table", "TABLE_FORMATS"]

TABLE_FORMATS = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".txt": "tsv", ".jsonl": "jsonl", ".json": "jsonl"}
_EXPECTED = ("a .csv, .tsv/.tab/.txt or .jsonl/.json file, a folder written by datasets' save_to_disk, "
             "or a local dataset folder")
_SHOW_SKIPPED = 10  # how many "file:line" of skipped rows CadData.skipped_where keeps
_INT = re.compile(r"[+-]?\d+")


@dataclass
class _Table:
    """The needed columns of a table, one value per row, and where each row is (for messages)."""

    name: str  # the path, or "path[split]" for a dataset split
    unit: str  # "line" (files) or "row" (datasets: the 0-based index)
    found: List[str]  # every column of the source
    cols: Dict[str, List[Any]]
    where: List[int]  # line (files) or row index (datasets) of each row
    class_names: Dict[str, List[str]] = field(default_factory=dict)  # ClassLabel columns: their names

    def loc(self, r: int) -> str:
        return f"{self.name}: {self.unit} {self.where[r]}"


def _list(names: Sequence[str]) -> str:
    return ", ".join(names) if names else "none"


# --------------------------------------------------------------------------------------------
# readers


def _lines(path: str) -> Iterator[str]:
    """The file's lines, decoded as UTF-8 (a byte-order mark at the start is dropped), one physical line each."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                yield raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: line {n}: not valid UTF-8 (byte {raw[e.start]:#04x} at byte {e.start + 1} "
                                f"of the line); expected a UTF-8 text file") from None


def _check_header(path: str, header: List[str], needed: Sequence[str], what: str) -> None:
    missing = [c for c in needed if c not in header]
    if missing:
        raise DataError(f"{path}: line 1: missing column(s) {_list(missing)}; expected {what} {_list(needed)}, "
                        f"found {_list([h for h in header if h])}")
    for c in needed:
        if header.count(c) > 1:
            raise DataError(f"{path}: line 1: column {c!r} appears {header.count(c)} times in the header; "
                            f"expected each column once")


def _read_delimited(path: str, needed: Sequence[str], tsv: bool) -> _Table:
    kind = "a tab-separated file (no quoting)" if tsv else "a comma-separated file (standard CSV quoting)"
    fmt = dict(delimiter="\t", quoting=csv.QUOTE_NONE) if tsv else dict(delimiter=",", quotechar='"', doublequote=True)
    header: Optional[List[str]] = None
    rows: List[List[str]] = []
    where: List[int] = []
    limit = csv.field_size_limit()
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # long documents
    reader = csv.reader(_lines(path), strict=not tsv, **fmt)
    start = 1
    try:
        while True:
            start = reader.line_num + 1
            try:
                rec = next(reader)
            except StopIteration:
                break
            if not rec or (len(rec) == 1 and not rec[0].strip()):
                continue  # a blank line is not a row
            if header is None:
                header = [h.strip() for h in rec]
                _check_header(path, header, needed, "columns")
                continue
            if len(rec) != len(header):
                hint = ("a tab inside a text?" if tsv else "a comma inside an unquoted text? quote the field") \
                    if len(rec) > len(header) else "a missing field?"
                raise DataError(f"{path}: line {start}: {len(rec)} field(s), expected {len(header)} "
                                f"(columns {_list(header)}; {hint})")
            rows.append(rec)
            where.append(start)
    except csv.Error as e:
        runs = f" (the record starting there runs to line {reader.line_num})" if reader.line_num > start else ""
        raise DataError(f"{path}: line {start}: cannot be parsed as {kind}: {e}{runs}") from None
    finally:
        csv.field_size_limit(limit)
    if header is None:
        raise DataError(f"{path}: file is empty; expected a header row (line 1) with columns {_list(needed)}, "
                        f"then one row per example")
    if not rows:
        raise DataError(f"{path}: no data rows (only the header, line 1); expected one row per example after it")
    index = {c: header.index(c) for c in needed}
    return _Table(path, "line", header, {c: [r[k] for r in rows] for c, k in index.items()}, where)


def _read_jsonl(path: str, needed: Sequence[str]) -> _Table:
    cols: Dict[str, List[Any]] = {c: [] for c in needed}
    where: List[int] = []
    found: Optional[List[str]] = None
    for n, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if n == 1 and line.lstrip().startswith("["):
                hint = "the file starts a JSON array; expected JSON Lines (one JSON object per line)"
            else:
                hint = "expected JSON Lines (one JSON object per line)"
            raise DataError(f"{path}: line {n}: not valid JSON: {e.msg} (column {e.colno}); {hint}") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}: line {n}: a JSON {type(obj).__name__}, expected an object with keys "
                            f"{_list(needed)} (JSON Lines: one object per line)")
        if found is None:
            found = list(obj)
        missing = [c for c in needed if c not in obj]
        if missing:
            raise DataError(f"{path}: line {n}: missing column(s) {_list(missing)}; expected keys {_list(needed)}, "
                            f"found {_list(list(obj))}")
        for c in needed:
            cols[c].append(obj[c])
        where.append(n)
    if found is None:
        raise DataError(f"{path}: file is empty; expected JSON Lines (one object per line) with keys {_list(needed)}")
    return _Table(path, "line", found, cols, where)


def _datasets():
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _pick_split(path: str, dd, split: Optional[str]):
    want = split or "train"
    if want not in dd:
        raise DataError(f"{path}: no split {want!r}; splits found: {_list(list(dd))} (choose one with split=)")
    return dd[want], f"{path}[{want}]"


def _read_dataset(ds, name: str, needed: Sequence[str]) -> _Table:
    datasets = _datasets()
    found = list(ds.column_names)
    missing = [c for c in needed if c not in found]
    if missing:
        raise DataError(f"{name}: missing column(s) {_list(missing)}; expected columns {_list(needed)}, "
                        f"found {_list(found)}")
    if ds.num_rows == 0:
        raise DataError(f"{name}: no rows; expected one row per example")
    class_names = {c: list(ds.features[c].names) for c in needed if isinstance(ds.features[c], datasets.ClassLabel)}
    cols = {c: list(ds[c]) for c in needed}
    return _Table(name, "row", found, cols, list(range(ds.num_rows)), class_names)


def _read_folder(path: str, needed: Sequence[str], split: Optional[str]) -> _Table:
    datasets = _datasets()
    if os.path.isfile(os.path.join(path, "dataset_dict.json")) or os.path.isfile(os.path.join(path, "state.json")):
        try:
            obj = datasets.load_from_disk(path)
        except Exception as e:
            raise DataError(f"{path}: cannot be loaded with datasets.load_from_disk: {_one_line(e)}") from e
        if isinstance(obj, datasets.DatasetDict):
            ds, name = _pick_split(path, obj, split)
        else:
            if split is not None:
                raise DataError(f"{path}: a single dataset (save_to_disk of a Dataset) has no splits, got "
                                f"split={split!r}; expected split=None")
            ds, name = obj, path
        return _read_dataset(ds, name, needed)
    # a folder of data files (or a dataset script, which recent `datasets` refuse): datasets.load_dataset, offline
    exts = {os.path.splitext(f)[1].lower() for _, _, files in os.walk(path) for f in files if not f.startswith(".")}
    data_exts = exts - {".md", ".py", ".yaml", ".yml", ".lock"}
    kwargs: Dict[str, Any] = {}
    if data_exts and data_exts <= {".csv", ".tsv"}:
        kwargs["keep_default_na"] = False  # every cell is text: "NA" stays "NA"
        if data_exts == {".tsv"}:
            kwargs["quoting"] = csv.QUOTE_NONE
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a failure is reported once, in the DataError
    try:
        obj = datasets.load_dataset(path, cache_dir=_cache_dir(), keep_in_memory=True, **kwargs)
    except Exception as e:
        raise DataError(f"{path}: cannot be loaded with datasets.load_dataset (a local dataset folder, offline): "
                        f"{_one_line(e)}; expected {_EXPECTED}") from e
    finally:
        datasets.logging.set_verbosity(verbosity)
    ds, name = _pick_split(path, obj, split) if isinstance(obj, datasets.DatasetDict) else (obj, path)
    return _read_dataset(ds, name, needed)


def read_rows(path: str, needed: Sequence[str], split: Optional[str]) -> _Table:
    """The raw rows of any file or folder `load_table` reads (every cell text), with the columns `needed` checked."""
    if not os.path.exists(path):
        raise DataError(f"{path}: file or folder not found; expected {_EXPECTED}")
    if os.path.isdir(path):
        return _read_folder(path, needed, split)
    ext = os.path.splitext(path)[1].lower()
    fmt = TABLE_FORMATS.get(ext)
    if fmt is None:
        raise DataError(f"{path}: unknown file type {ext or '(no extension)'!r}; expected {_EXPECTED}")
    if split is not None:
        raise DataError(f"{path}: split={split!r} applies to dataset folders only; expected split=None for a file")
    if fmt == "jsonl":
        return _read_jsonl(path, needed)
    return _read_delimited(path, needed, tsv=fmt == "tsv")


# --------------------------------------------------------------------------------------------
# cells


class _Bad(Exception):
    """A cell that is not what it should be (the reason; the caller adds where)."""


def _name(v: Any) -> Optional[str]:
    """A label, group id or example id as a string (None when empty). Integers and integral floats as integers."""
    if v is None:
        return None
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return None
        if v.is_integer():
            return str(int(v))
        raise _Bad(f"a fractional number {v!r}")
    if isinstance(v, str):
        return v.strip() or None
    raise _Bad(f"a {type(v).__name__} ({str(v)[:40]!r})")


def _text(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return "" if isinstance(v, float) and math.isnan(v) else str(v)
    raise _Bad(f"a {type(v).__name__} ({str(v)[:40]!r})")


def _label_order(names) -> List[str]:
    names = set(names)
    if all(_INT.fullmatch(n) for n in names):
        return sorted(names, key=lambda n: (int(n), n))
    return sorted(names)


def _given_labels(labels: Sequence[Any]) -> Tuple[str, ...]:
    if isinstance(labels, (str, bytes)):
        raise DataError(f"labels={labels!r}: expected a sequence of label names, e.g. ['negative', 'positive']")
    out = []
    for v in labels:
        try:
            n = _name(v)
        except _Bad as e:
            raise DataError(f"labels=: {e} is not a label name; expected strings or integers") from None
        if n is None:
            raise DataError(f"labels=: an empty label name ({v!r}); expected non-empty strings or integers")
        if n in out:
            raise DataError(f"labels=: label {n!r} given twice; expected each label once")
        out.append(n)
    if not out:
        raise DataError("labels=: no labels; expected at least one label name (or labels=None: the file's labels)")
    return tuple(out)


# --------------------------------------------------------------------------------------------
# the loader


def load_table(
    path,
    *,
    text_column: str,
    label_column: str,
    text_pair_column: Optional[str] = None,
    group_column: Optional[str] = None,
    labels: Optional[Sequence[Any]] = None,
    clean_text: bool = True,
    id_column: Optional[str] = None,
    split: Optional[str] = None,
) -> CadData:
    """Examples from a user's file or dataset folder (see the module docstring for formats).

    * ``text_column`` (and ``text_pair_column`` for text pairs, e.g. NLI premise / hypothesis): the texts;
      a row whose text or pair text is empty or only whitespace is skipped and counted (``skipped``,
      ``skipped_where``: "file:line" of the first few). ``clean_text``: :func:`~cat_fast.data.core.clean`.
    * ``label_column``: strings or integers. ``labels``: the label names in id order (a row with another label is
      an error); default: every distinct value (integers numerically, other strings in Python's string order, upper
      case first; a ``ClassLabel`` column: its names). ``CadData.label_names`` are strings (for a checkpoint's id2label).
    * ``group_column``: rows sharing an id are counterfactuals of each other; the first row of a group (file order)
      is its original, the rest its edits; partners = members of a group with different labels. Without it every
      row is its own group (no pairs).
    * ``id_column``: a unique example id per row (default: the 0-based row index, blank-text rows counted), in
      ``CadData.ids`` as strings.
    * ``split``: the split of a ``DatasetDict`` folder (default ``"train"``).

    Raises :class:`~cat_fast.data.core.DataError` (one line: file, line, cause, what was expected).
    """
    path = os.fspath(path)
    roles = [("text_column", text_column), ("text_pair_column", text_pair_column), ("label_column", label_column),
             ("group_column", group_column), ("id_column", id_column)]
    for role, c in roles:
        if c is not None and (not isinstance(c, str) or not c):
            raise DataError(f"{role}={c!r}: expected a column name")
    texts_and_label = [c for _, c in roles[:3] if c is not None]
    if len(set(texts_and_label)) != len(texts_and_label):
        raise DataError(f"text_column={text_column!r}, text_pair_column={text_pair_column!r} and "
                        f"label_column={label_column!r}: expected different columns")
    needed = list(dict.fromkeys(c for _, c in roles if c is not None))
    allowed = None if labels is None else _given_labels(labels)

    t = read_rows(path, needed, split)
    class_names = t.class_names.get(label_column)
    n_rows = len(t.where)
    text: List[str] = []
    pair: Optional[List[str]] = [] if text_pair_column else None
    names: List[str] = []
    is_orig: List[bool] = []
    group: List[int] = []
    sources: List[str] = []
    ids: List[str] = []
    group_of: Dict[Tuple[str, Any], int] = {}  # group key -> group number, in order of first appearance
    id_row: Dict[str, int] = {}
    skipped, skipped_where = 0, []

    def cell(r: int, col: str, fn):
        try:
            return fn(t.cols[col][r])
        except _Bad as e:
            raise DataError(f"{t.loc(r)}: column {col!r} holds {e}; expected text, a string or an integer") from None

    for r in range(n_rows):
        a = cell(r, text_column, _text)
        b = cell(r, text_pair_column, _text) if text_pair_column else None
        if clean_text:
            a = clean(a)
            b = None if b is None else clean(b)
        if not a.strip() or (b is not None and not b.strip()):
            skipped += 1
            if len(skipped_where) < _SHOW_SKIPPED:
                skipped_where.append(f"{t.name}:{t.where[r]}")
            continue
        # label
        v = t.cols[label_column][r]
        if class_names is not None and isinstance(v, int) and not isinstance(v, bool):
            if not 0 <= v < len(class_names):
                raise DataError(f"{t.loc(r)}: label {v} in column {label_column!r} is not a class of its ClassLabel "
                                f"(0..{len(class_names) - 1}: {_list(class_names)}; -1 marks an unlabelled row)")
            y = class_names[v]
        else:
            y = cell(r, label_column, _name)
        if y is None:
            raise DataError(f"{t.loc(r)}: empty label in column {label_column!r}; expected "
                            f"{'one of ' + _list(allowed) if allowed else 'a label (a string or an integer)'}")
        if allowed is not None and y not in allowed:
            raise DataError(f"{t.loc(r)}: unknown label {y!r} in column {label_column!r}; allowed labels: "
                            f"{_list(allowed)}")
        # id
        if id_column is not None:
            ex = cell(r, id_column, _name)
            if ex is None:
                raise DataError(f"{t.loc(r)}: empty id in column {id_column!r}; expected a unique id per row")
            if ex in id_row:
                raise DataError(f"{t.loc(r)}: id {ex!r} in column {id_column!r} repeats the id of "
                                f"{t.unit} {t.where[id_row[ex]]}; expected a unique id per row")
            id_row[ex] = r
        else:
            ex = str(r)
        # group
        g = cell(r, group_column, _name) if group_column is not None else None
        key = ("row", r) if g is None else ("id", g)  # no group id: a group of its own
        first = key not in group_of
        group_of.setdefault(key, len(group_of))
        text.append(a)
        if pair is not None:
            pair.append(b)
        names.append(y)
        is_orig.append(first)
        group.append(group_of[key])
        sources.append(f"{t.name}:{t.where[r]}")
        ids.append(ex)

    if not text:
        cols = " / ".join(c for c in (text_column, text_pair_column) if c)
        raise DataError(f"{t.name}: all {n_rows} row(s) have empty text in column(s) {cols} (first: "
                        f"{_list(skipped_where[:3])}); expected at least one row with text")
    if allowed is not None:
        label_names = allowed
    elif class_names is not None and set(names) <= set(class_names):
        label_names = tuple(class_names)
    else:
        label_names = tuple(_label_order(names))
    index = {n: i for i, n in enumerate(label_names)}
    text_columns = (text_column, text_pair_column) if text_pair_column else (text_column,)
    spec = TaskSpec("custom", label_column, text_columns, label_names)
    return CadData(spec, text, pair, [index[n] for n in names], is_orig, group, sources, ids=ids,
                   pairing="all", skipped=skipped, skipped_where=skipped_where)
