"""The readers behind :func:`~cat_fast.data.load_table`: one per format, each giving the raw rows of the columns a
caller needs (:func:`read_rows`), with the line (files) or 0-based row / item (datasets, JSON arrays) of each row for
messages. A caller may name its columns only once the source's own columns are known (``needed`` as a function of
them): the loader finds columns by name that way, without reading a file twice.

A choice a reader cannot make alone (which split of several) raises :class:`ChoiceError`, whose message a command
line can reword with its own option names (:meth:`ChoiceError.advise`).
"""
from __future__ import annotations

import csv
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from .core import DataError, _cache_dir, _one_line

__all__ = ["read_rows", "ChoiceError", "TABLE_FORMATS", "is_hub_name"]

TABLE_FORMATS = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".txt": "tsv", ".jsonl": "jsonl", ".json": "json"}
EXPECTED = ("a .csv, .tsv/.tab/.txt, .jsonl or .json file (JSON Lines or a JSON array of objects), a folder written "
            "by datasets' save_to_disk, a local dataset folder, or a dataset in the local Hugging Face cache "
            "(NAME, ORG/NAME or ORG/NAME:CONFIG)")
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?(:[\w.-]+)?")

# the columns a caller needs: a list, or a function of the source's columns and its name (for messages)
Needed = Union[Sequence[str], Callable[[List[str], str], Sequence[str]]]


class ChoiceError(DataError):
    """A choice the data leaves open (several splits, several candidate columns). ``message`` says what was found,
    ``keywords`` the :func:`~cat_fast.data.load_table` keywords that make the choice."""

    def __init__(self, message: str, keywords: Sequence[str]):
        self.message, self.keywords = message, tuple(keywords)
        super().__init__(self.advise({k: f"{k}=" for k in self.keywords}))

    def advise(self, how: Mapping[str, str]) -> str:
        """The message, ending with how to choose: ``how`` maps each keyword to its wording (e.g. a CLI option)."""
        return f"{self.message}; choose with {' / '.join(how[k] for k in self.keywords)}"


@dataclass
class Table:
    """The needed columns of a table, one value per row, and where each row is (for messages)."""

    name: str  # the path, or "path[split]" for a dataset split
    unit: str  # "line" (files), "row" (datasets: the 0-based index) or "item" (a JSON array: the 0-based index)
    found: List[str]  # every column of the source
    cols: Dict[str, List[Any]]
    where: List[int]  # line, row or item of each row
    class_names: Dict[str, List[str]] = field(default_factory=dict)  # ClassLabel columns: their names

    def loc(self, r: int) -> str:
        return f"{self.name}: {self.unit} {self.where[r]}"


def listed(names: Sequence[str]) -> str:
    return ", ".join(names) if names else "none"


def _resolve(needed: Needed, found: List[str], name: str) -> List[str]:
    return list(needed(found, name) if callable(needed) else needed)


def _with(needed: Needed, what: str = "columns") -> str:
    """" with columns a, b" where the needed columns are known before reading."""
    return "" if callable(needed) else f" with {what} {listed(list(needed))}"


# --------------------------------------------------------------------------------------------
# files


def _lines(path: str) -> Iterator[str]:
    """The file's lines, decoded as UTF-8 (a byte-order mark at the start is dropped), one physical line each."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                yield raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: line {n}: not valid UTF-8 (byte {raw[e.start]:#04x} at byte {e.start + 1} "
                                f"of the line); expected a UTF-8 text file") from None


def _check_header(path: str, header: List[str], needed: Sequence[str]) -> None:
    missing = [c for c in needed if c not in header]
    if missing:
        raise DataError(f"{path}: line 1: missing column(s) {listed(missing)}; expected columns {listed(needed)}, "
                        f"found {listed([h for h in header if h])}")
    for c in needed:
        if header.count(c) > 1:
            raise DataError(f"{path}: line 1: column {c!r} appears {header.count(c)} times in the header; "
                            f"expected each column once")


def _read_delimited(path: str, needed: Needed, tsv: bool) -> Table:
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
                needed = _resolve(needed, [h for h in header if h], path)
                _check_header(path, header, needed)
                continue
            if len(rec) != len(header):
                hint = ("a tab inside a text?" if tsv else "a comma inside an unquoted text? quote the field") \
                    if len(rec) > len(header) else "a missing field?"
                raise DataError(f"{path}: line {start}: {len(rec)} field(s), expected {len(header)} "
                                f"(columns {listed(header)}; {hint})")
            rows.append(rec)
            where.append(start)
    except csv.Error as e:
        runs = f" (the record starting there runs to line {reader.line_num})" if reader.line_num > start else ""
        raise DataError(f"{path}: line {start}: cannot be parsed as {kind}: {e}{runs}") from None
    finally:
        csv.field_size_limit(limit)
    if header is None:
        raise DataError(f"{path}: file is empty; expected a header row (line 1){_with(needed)}, then one row per "
                        f"example")
    if not rows:
        raise DataError(f"{path}: no data rows (only the header, line 1); expected one row per example after it")
    index = {c: header.index(c) for c in needed}
    return Table(path, "line", header, {c: [r[k] for r in rows] for c, k in index.items()}, where)


def _objects(path: str, objs: Iterator, unit: str, needed: Needed) -> Table:
    """The rows of (number, object) pairs: JSON Lines (line numbers) or a JSON array (0-based items)."""
    cols: Dict[str, List[Any]] = {}
    where: List[int] = []
    found: Optional[List[str]] = None
    form = "JSON Lines: one object per line" if unit == "line" else "a JSON array of objects"
    for n, obj in objs:
        if not isinstance(obj, dict):
            raise DataError(f"{path}: {unit} {n}: a JSON {type(obj).__name__}, expected an object ({form})")
        if found is None:
            found = list(obj)
            needed = _resolve(needed, found, path)
            cols = {c: [] for c in needed}
        missing = [c for c in cols if c not in obj]
        if missing:
            raise DataError(f"{path}: {unit} {n}: missing column(s) {listed(missing)}; expected keys "
                            f"{listed(list(cols))}, found {listed(list(obj))}")
        for c in cols:
            cols[c].append(obj[c])
        where.append(n)
    if found is None:
        raise DataError(f"{path}: {'file is empty' if unit == 'line' else 'an empty array'}; expected {form}{_with(needed, 'keys')}")
    return Table(path, unit, found, cols, where)


def _jsonl_objects(path: str, array_ok: bool) -> Iterator:
    for n, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            if n == 1 and line.lstrip().startswith("[") and not array_ok:
                hint = "the file starts a JSON array; expected JSON Lines (one JSON object per line), or name it .json"
            else:
                hint = "expected JSON Lines (one JSON object per line)" + (" or a JSON array" if array_ok else "")
            raise DataError(f"{path}: line {n}: not valid JSON: {e.msg} (column {e.colno}); {hint}") from None


def _read_json(path: str, needed: Needed, array_ok: bool) -> Table:
    """JSON Lines, or (``array_ok``, a file whose first character is ``[``) one JSON array of objects."""
    with open(path, "rb") as f:
        head = f.read(4096).decode("utf-8-sig", errors="replace").lstrip()
    if not (array_ok and head.startswith("[")):
        return _objects(path, _jsonl_objects(path, array_ok), "line", needed)
    text = "".join(_lines(path))
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: line {e.lineno}: not valid JSON: {e.msg} (column {e.colno}); expected a JSON array "
                        f"of objects") from None
    if not isinstance(items, list):
        raise DataError(f"{path}: a JSON {type(items).__name__}, expected a JSON array of objects")
    return _objects(path, enumerate(items), "item", needed)


# --------------------------------------------------------------------------------------------
# datasets


def datasets_offline():
    """The ``datasets`` module, offline and quiet: nothing is downloaded, a hub name is read from the cache."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.config.HF_HUB_OFFLINE = True  # also when datasets was imported before, without the variable
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _pick_split(name: str, dd, split: Optional[str], default_split: str):
    """``split``, else the only split, else ``default_split``; a ChoiceError lists the splits."""
    splits = list(dd)
    if split is None:
        if len(splits) == 1:
            split = splits[0]
        elif default_split in dd:
            split = default_split
        else:
            raise ChoiceError(f"{name}: {len(splits)} splits ({listed(splits)}) and none is {default_split!r}",
                              ["split"])
    elif split not in dd:
        raise ChoiceError(f"{name}: no split {split!r}; splits found: {listed(splits)}", ["split"])
    return dd[split], f"{name}[{split}]"


def _read_dataset(ds, name: str, needed: Needed) -> Table:
    datasets = datasets_offline()
    found = list(ds.column_names)
    needed = _resolve(needed, found, name)
    missing = [c for c in needed if c not in found]
    if missing:
        raise DataError(f"{name}: missing column(s) {listed(missing)}; expected columns {listed(needed)}, "
                        f"found {listed(found)}")
    if ds.num_rows == 0:
        raise DataError(f"{name}: no rows; expected one row per example")
    class_names = {c: list(ds.features[c].names) for c in needed if isinstance(ds.features[c], datasets.ClassLabel)}
    cols = {c: list(ds[c]) for c in needed}
    return Table(name, "row", found, cols, list(range(ds.num_rows)), class_names)


def _read_object(obj, name: str, needed: Needed, split: Optional[str], default_split: str) -> Table:
    """A ``datasets.Dataset``, or a split of a ``DatasetDict``."""
    datasets = datasets_offline()
    if isinstance(obj, datasets.DatasetDict):
        ds, name = _pick_split(name, obj, split, default_split)
    elif isinstance(obj, datasets.Dataset):
        if split is not None:
            raise DataError(f"{name}: a single dataset (a Dataset, or save_to_disk of one) has no splits, got "
                            f"split={split!r}; expected split=None")
        ds = obj
    else:
        raise DataError(f"{name}: a {type(obj).__name__}; expected {EXPECTED}, a datasets.Dataset or DatasetDict")
    return _read_dataset(ds, name, needed)


def _read_folder(path: str, needed: Needed, split: Optional[str], default_split: str) -> Table:
    datasets = datasets_offline()
    if os.path.isfile(os.path.join(path, "dataset_dict.json")) or os.path.isfile(os.path.join(path, "state.json")):
        try:
            obj = datasets.load_from_disk(path)
        except Exception as e:
            raise DataError(f"{path}: cannot be loaded with datasets.load_from_disk: {_one_line(e)}") from e
        return _read_object(obj, path, needed, split, default_split)
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
                        f"{_one_line(e)}; expected {EXPECTED}") from e
    finally:
        datasets.logging.set_verbosity(verbosity)
    return _read_object(obj, path, needed, split, default_split)


def is_hub_name(name: str) -> bool:
    """``NAME``, ``ORG/NAME`` or either with ``:CONFIG``, and no file extension of a table: a dataset name of the
    Hugging Face hub (read from the local cache only)."""
    return (bool(_HUB_NAME.fullmatch(name)) and not os.path.exists(name)
            and os.path.splitext(name.partition(":")[0])[1].lower() not in TABLE_FORMATS)


def _read_hub(name: str, needed: Needed, split: Optional[str], default_split: str) -> Table:
    """A dataset of the Hugging Face hub by name, from the local ``datasets`` cache (offline). ``ORG/NAME:CONFIG``
    names a configuration; ``NAME/CONFIG`` (``glue/sst2``) is also tried as ``NAME`` with configuration
    ``CONFIG`` when no ``ORG/NAME`` is cached."""
    datasets = datasets_offline()
    repo, _, config = name.partition(":")
    attempts = [(repo, config or None)]
    if "/" in repo and not config:
        attempts.append(tuple(repo.split("/", 1)))
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a failure is reported once, in the DataError
    errors = []
    try:
        for path, cfg in attempts:
            try:
                obj = datasets.load_dataset(path, cfg, keep_in_memory=True)
                break
            except Exception as e:  # not cached (or another configuration is): the next reading, else the error
                errors.append(_one_line(e))
        else:
            raise DataError(f"{name}: not a file or folder, and not a dataset in the local Hugging Face cache "
                            f"({datasets.config.HF_DATASETS_CACHE}; nothing is downloaded: load it once with "
                            f"datasets.load_dataset where the hub is reachable): {errors[0]}; expected {EXPECTED}")
    finally:
        datasets.logging.set_verbosity(verbosity)
    return _read_object(obj, name, needed, split, default_split)


def read_rows(source, needed: Needed, split: Optional[str], default_split: str = "train") -> Table:
    """The raw rows of any source :func:`~cat_fast.data.load_table` reads (a path, or a ``datasets.Dataset`` /
    ``DatasetDict``), with the columns ``needed`` (a list, or a function of the source's columns and its name)
    checked. ``split``: a ``DatasetDict``'s split; ``None``: its only split, else ``default_split``."""
    if not isinstance(source, (str, os.PathLike)):
        return _read_object(source, type(source).__name__, needed, split, default_split)
    path = os.fspath(source)
    if not os.path.exists(path) and is_hub_name(path):
        return _read_hub(path, needed, split, default_split)
    if not os.path.exists(path):
        raise DataError(f"{path}: file or folder not found; expected {EXPECTED}")
    if os.path.isdir(path):
        return _read_folder(path, needed, split, default_split)
    ext = os.path.splitext(path)[1].lower()
    fmt = TABLE_FORMATS.get(ext)
    if fmt is None:
        raise DataError(f"{path}: unknown file type {ext or '(no extension)'!r}; expected {EXPECTED}")
    if split is not None:
        raise DataError(f"{path}: split={split!r} applies to dataset folders only; expected split=None for a file")
    if fmt in ("json", "jsonl"):
        return _read_json(path, needed, array_ok=fmt == "json")
    return _read_delimited(path, needed, tsv=fmt == "tsv")
