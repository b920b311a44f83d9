"""The columns of a training file that a feature bias model reads (:class:`~cat_fast.bias.FeatureBias`,
docs/METHODS.md §4): besides the text and label that :func:`cat_fast.data.load_table` keeps, any other column
(a genre, a source, a length, a planted cue), read again from the same file and aligned to the examples.

Typical use::

    train = data.load_table("train.csv")
    cols = read_feature_columns(train, ["genre", "n_words"])     # {"genre": [...], "n_words": [...]}, rows of train
    features = typed_columns(train, cols)                        # FeatureColumn per column: categorical or numeric

Rows are matched by where they are (``CadData.sources``: ``"file:line"``, ``"folder[split]:row"``), so blank-text
rows that the loader skipped are skipped here too. A column holds numbers when every value is a number (or, in a
CSV/TSV file, text that reads as one); it is then numeric unless named in ``categorical``. Every other column is
categorical; its values are compared as text (``"NA"`` is a category, as the readers keep it).
Refused with :class:`FeatureColumnError` (naming the column): a column the file lacks, a missing value (empty or
blank text, JSON null, NaN), a non-finite number, a column with one value for every row.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

__all__ = ["FeatureColumnError", "FeatureColumn", "read_feature_columns", "typed_columns"]

_NUMBER = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")
_SPLIT = re.compile(r"^(.*)\[([^\[\]]+)\]$")  # "folder[split]": a dataset split, as the readers name it


class FeatureColumnError(ValueError):
    """A feature column that cannot be used (the message names it and the file or row)."""


@dataclass
class FeatureColumn:
    """One feature column over all examples: ``kind`` ``"categorical"`` (``values``: strings) or ``"numeric"``
    (``values``: floats)."""

    name: str
    kind: str
    values: List[Any]


def _source_of(name: str) -> Tuple[str, Any]:
    """``(path, split)`` behind a source name of `CadData.sources` (a file, a dataset folder or a hub dataset name,
    with ``[split]``); one that no longer exists is for the reader to name."""
    m = _SPLIT.match(name)
    if m and not os.path.exists(name):
        return m.group(1), m.group(2)
    return name, None


def read_feature_columns(data, columns: Sequence[str]) -> Dict[str, List[Any]]:
    """The raw values of ``columns`` for each example of ``data`` (a :class:`~cat_fast.data.CadData` read from files,
    which records each example's ``sources``), in ``data``'s order."""
    from ..data.readers import read_rows

    columns = list(dict.fromkeys(columns))
    if not columns or not all(isinstance(c, str) and c for c in columns):
        raise FeatureColumnError(f"feature columns {columns!r}: expected one or more column names")
    sources = list(getattr(data, "sources", None) or [])
    if len(sources) != len(data):
        raise FeatureColumnError("the examples do not record the file and row they were read from (CadData.sources);"
                                 " expected data read by cat_fast.data.load_table")
    where = [s.rpartition(":") for s in sources]
    out: Dict[str, List[Any]] = {c: [None] * len(data) for c in columns}
    for name in dict.fromkeys(w[0] for w in where):
        path, split = _source_of(name)

        def needed(found: List[str], label: str) -> List[str]:
            missing = [c for c in columns if c not in found]
            if missing:
                raise FeatureColumnError(f"feature column(s) {', '.join(map(repr, missing))} not in {label} (its "
                                         f"columns: {', '.join(found)})")
            return columns

        table = read_rows(path, needed, split)
        row = {f"{table.name}:{w}": r for r, w in enumerate(table.where)}
        for i, (src, _, at) in enumerate(where):
            if src != name:
                continue
            r = row.get(f"{src}:{at}")
            if r is None:
                raise FeatureColumnError(f"{src}: no row at {at} (example {data.ids[i]!r}); the file changed since "
                                         f"the examples were read?")
            for c in columns:
                out[c][i] = table.cols[c][r]
    return out


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or (isinstance(v, str) and not v.strip())


def _number(v: Any):
    """The float of a number or of text that reads as one; None otherwise."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and _NUMBER.fullmatch(v):
        return float(v)
    return None


def _category(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True)


def typed_columns(data, raw: Dict[str, List[Any]], categorical: Sequence[str] = ()) -> List[FeatureColumn]:
    """``raw`` (:func:`read_feature_columns`) as checked :class:`FeatureColumn` s; a column of numbers is numeric
    unless named in ``categorical``."""
    unknown = [c for c in categorical if c not in raw]
    if unknown:
        raise FeatureColumnError(f"categorical column(s) {', '.join(map(repr, unknown))} are not feature columns "
                                 f"({', '.join(raw)})")
    sources = list(getattr(data, "sources", None) or [])
    out = []
    for name, values in raw.items():
        bad = next((i for i, v in enumerate(values) if _missing(v)), None)
        if bad is not None:
            n = sum(map(_missing, values))
            at = sources[bad] if sources else f"example {bad}"
            raise FeatureColumnError(f"feature column {name!r} has {n} missing value(s) (first: {at}, "
                                     f"{values[bad]!r}); expected a value in every row")
        numbers = [_number(v) for v in values]
        if name not in categorical and all(x is not None for x in numbers):
            bad = next((i for i, x in enumerate(numbers) if not math.isfinite(x)), None)
            if bad is not None:
                at = sources[bad] if sources else f"example {bad}"
                raise FeatureColumnError(f"feature column {name!r}: {values[bad]!r} at {at} is not finite; expected "
                                         f"finite numbers")
            column = FeatureColumn(name, "numeric", numbers)
        else:
            column = FeatureColumn(name, "categorical", [_category(v) for v in values])
        if len(set(column.values)) < 2:
            raise FeatureColumnError(f"feature column {name!r} is constant ({values[0]!r} in all {len(values)} "
                                     f"rows); a constant carries no bias, expected at least two values")
        out.append(column)
    return out
