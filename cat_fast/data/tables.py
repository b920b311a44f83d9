"""Your own data: :func:`load_table` reads a CSV, TSV, JSON Lines or JSON file, a Hugging Face dataset folder or a
``datasets.Dataset`` / ``DatasetDict`` into a :class:`~cat_fast.data.core.CadData` with its own label set (a
:class:`~cat_fast.data.core.TaskSpec` of its own).

Typical use::

    from cat_fast import data
    train = data.load_table("train.csv", text_column="review", label_column="label", group_column="pair_id")
    train = data.load_table("train.jsonl")                       # columns found by name: text / label, ...
    print(train.describe(), train.label_names, train.skipped)   # label names for the checkpoint's id2label
    ds = data.TokenizedData(train, tokenizer, max_length=128)    # then make_batches / Collator as for CAD data

What ``path`` is decides the format: ``.csv`` (comma, standard quoting: fields with commas, quotes or newlines in
double quotes); ``.tsv`` / ``.tab`` / ``.txt`` (tab, no quoting: the CAD files' convention); ``.jsonl`` (JSON Lines:
one object per line); ``.json`` (JSON Lines, or one JSON array of objects); a folder written by
``datasets.Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``, or a ``Dataset`` / ``DatasetDict`` object (a
``DatasetDict``: ``split=``, else its only split, else ``default_split``, ``"train"``); any other folder goes to
``datasets.load_dataset(path)`` offline (a folder of data files). Every CSV/TSV cell is text ("NA" stays "NA"); a
UTF-8 byte-order mark is ignored; blank lines are not rows.

Columns not given are found by the names of ``run_glue.py`` and the datasets hub (:func:`find_columns`): the text
from ``text`` / ``sentence`` / ``review``, a text pair from ``sentence1`` + ``sentence2``, ``premise`` +
``hypothesis`` or ``question`` + ``sentence``, the label from ``label`` / ``labels``; none or several candidates is
a :class:`~cat_fast.data.readers.ChoiceError`. A given ``text_column`` also decides the pair (none unless given).

Rows whose text (or pair text) is empty or only whitespace are skipped and counted (``CadData.skipped``,
``CadData.skipped_where``). Labels: the names in ``labels=``, else every distinct value (integers in numeric order,
other strings alphabetically; a ``ClassLabel`` column keeps its own names and order). Groups (``group_column``):
rows sharing an id are counterfactuals of each other, the first in file order is the original, and any two members
with different labels are partners (``pairing="all"``); a row with an empty group id is a group of its own.
Every problem raises :class:`~cat_fast.data.core.DataError` on one line: the file, the line (CSV/TSV: the header is
line 1; JSONL: the line; a dataset: the 0-based row; a JSON array: the 0-based item), what is wrong and what was
expected.
"""
from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .core import CadData, DataError, TaskSpec, clean
from .readers import TABLE_FORMATS, ChoiceError, Table, listed, read_rows  # noqa: F401  (read_rows: for .hans)

__all__ = ["load_table", "find_columns", "ChoiceError", "TABLE_FORMATS", "TEXT_NAMES", "PAIR_NAMES", "LABEL_NAMES"]

# the column names of run_glue.py and the datasets hub, in the order a message lists them
TEXT_NAMES = ("text", "sentence", "review")
PAIR_NAMES = (("sentence1", "sentence2"), ("premise", "hypothesis"), ("question", "sentence"))
LABEL_NAMES = ("label", "labels")

_SHOW_SKIPPED = 10  # how many "file:line" of skipped rows CadData.skipped_where keeps
_INT = re.compile(r"[+-]?\d+")


def find_columns(found: Sequence[str], text_column: Optional[str] = None, text_pair_column: Optional[str] = None,
                 label_column: Optional[str] = None, name: str = "the data") -> Tuple[str, Optional[str], str]:
    """``(text_column, text_pair_column, label_column)``: those given, the others found among the columns ``found``
    by name (:data:`TEXT_NAMES`, :data:`PAIR_NAMES`, :data:`LABEL_NAMES`). A complete pair is one candidate (its
    members are not single-text candidates: ``question`` + ``sentence`` is QNLI's pair); a given ``text_column``
    decides the pair too. No candidate, or several, raises :class:`ChoiceError` naming them (``name``: the source)."""
    if text_pair_column is not None and text_column is None:
        raise DataError(f"text_pair_column={text_pair_column!r} needs text_column= (the first text of the pair)")
    have = set(found)
    if text_column is None:
        pairs: List[Tuple[str, Optional[str]]] = [p for p in PAIR_NAMES if p[0] in have and p[1] in have]
        in_pairs = {c for p in pairs for c in p}
        candidates = pairs + [(c, None) for c in TEXT_NAMES if c in have and c not in in_pairs]
        if len(candidates) != 1:
            shown = [" + ".join(c for c in p if c) for p in candidates]
            said = (f"several text columns found by name: {listed(shown)}" if candidates else
                    f"no text column found by name (looked for {listed(TEXT_NAMES)} and the pairs "
                    f"{listed([' + '.join(p) for p in PAIR_NAMES])}); found columns {listed(list(found))}")
            raise ChoiceError(f"{name}: {said}", ["text_column", "text_pair_column"])
        text_column, text_pair_column = candidates[0]
    if label_column is None:
        candidates = [c for c in LABEL_NAMES if c in have and c not in (text_column, text_pair_column)]
        if len(candidates) != 1:
            said = (f"several label columns found by name: {listed(candidates)}" if candidates else
                    f"no label column found by name (looked for {listed(LABEL_NAMES)}); found columns "
                    f"{listed(list(found))}")
            raise ChoiceError(f"{name}: {said}", ["label_column"])
        label_column = candidates[0]
    return text_column, text_pair_column, label_column


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


def _cell(t: Table, r: int, col: str, fn):
    try:
        return fn(t.cols[col][r])
    except _Bad as e:
        raise DataError(f"{t.loc(r)}: column {col!r} holds {e}; expected text, a string or an integer") from None


def _label(t: Table, r: int, column: str, allowed: Optional[Tuple[str, ...]]) -> str:
    class_names = t.class_names.get(column)
    v = t.cols[column][r]
    if class_names is not None and isinstance(v, int) and not isinstance(v, bool):
        if not 0 <= v < len(class_names):
            raise DataError(f"{t.loc(r)}: label {v} in column {column!r} is not a class of its ClassLabel "
                            f"(0..{len(class_names) - 1}: {listed(class_names)}; -1 marks an unlabelled row)")
        y = class_names[v]
    else:
        y = _cell(t, r, column, _name)
    if y is None:
        raise DataError(f"{t.loc(r)}: empty label in column {column!r}; expected "
                        f"{'one of ' + listed(allowed) if allowed else 'a label (a string or an integer)'}")
    if allowed is not None and y not in allowed:
        raise DataError(f"{t.loc(r)}: unknown label {y!r} in column {column!r}; allowed labels: {listed(allowed)}")
    return y


# --------------------------------------------------------------------------------------------
# the loader


def load_table(
    path,
    *,
    text_column: Optional[str] = None,
    label_column: Optional[str] = None,
    text_pair_column: Optional[str] = None,
    group_column: Optional[str] = None,
    labels: Optional[Sequence[Any]] = None,
    clean_text: bool = True,
    id_column: Optional[str] = None,
    split: Optional[str] = None,
    default_split: str = "train",
) -> CadData:
    """Examples from a user's file, dataset folder or ``datasets`` object (see the module docstring for formats).

    * ``text_column`` (and ``text_pair_column`` for text pairs, e.g. NLI premise / hypothesis): the texts;
      a row whose text or pair text is empty or only whitespace is skipped and counted (``skipped``,
      ``skipped_where``: "file:line" of the first few). ``clean_text``: :func:`~cat_fast.data.core.clean`.
      Not given: found by name (:func:`find_columns`); ``CadData.spec.text_columns`` says which.
    * ``label_column``: strings or integers (not given: found by name, ``CadData.spec.label_column``). ``labels``:
      the label names in id order (a row with another label is an error); default: every distinct value (integers
      numerically, other strings in Python's string order, upper case first; a ``ClassLabel`` column: its names).
      ``CadData.label_names`` are strings (for a checkpoint's id2label).
    * ``group_column``: rows sharing an id are counterfactuals of each other; the first row of a group (file order)
      is its original, the rest its edits; partners = members of a group with different labels. Without it every
      row is its own group (no pairs).
    * ``id_column``: a unique example id per row (default: the 0-based row index, blank-text rows counted), in
      ``CadData.ids`` as strings.
    * ``split``: the split of a ``DatasetDict`` (default: its only split, else ``default_split``).

    Raises :class:`~cat_fast.data.core.DataError` (one line: file, line, cause, what was expected); a choice left
    open (columns by name, a split) is its subclass :class:`ChoiceError`.
    """
    given = {"text_column": text_column, "text_pair_column": text_pair_column, "label_column": label_column,
             "group_column": group_column, "id_column": id_column}
    for role, c in given.items():
        if c is not None and (not isinstance(c, str) or not c):
            raise DataError(f"{role}={c!r}: expected a column name")
    if text_pair_column is not None and text_column is None:
        find_columns([], text_column, text_pair_column)  # raises: a pair needs its first text
    allowed = None if labels is None else _given_labels(labels)
    roles: Dict[str, Optional[str]] = {}

    def needed(found: List[str], name: str) -> List[str]:
        text, pair, label = find_columns(found, text_column, text_pair_column, label_column, name)
        chosen = [c for c in (text, pair, label) if c is not None]
        if len(set(chosen)) != len(chosen):
            raise DataError(f"text_column={text!r}, text_pair_column={pair!r} and label_column={label!r}: expected "
                            f"different columns")
        roles.update(text=text, pair=pair, label=label)
        return list(dict.fromkeys(c for c in (text, pair, label, group_column, id_column) if c is not None))

    given_all = text_column is not None and label_column is not None  # nothing to find: the list, for messages
    t = read_rows(path, needed([], "") if given_all else needed, split, default_split)
    return _examples(t, roles["text"], roles["pair"], roles["label"], group_column, id_column, allowed, clean_text)


def _examples(t: Table, text_column: str, text_pair_column: Optional[str], label_column: str,
              group_column: Optional[str], id_column: Optional[str], allowed: Optional[Tuple[str, ...]],
              clean_text: bool) -> CadData:
    """The rows of ``t`` as examples: texts cleaned, blank ones skipped, labels, ids and groups checked."""
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
    for r in range(n_rows):
        a = _cell(t, r, text_column, _text)
        b = _cell(t, r, text_pair_column, _text) if text_pair_column else None
        if clean_text:
            a = clean(a)
            b = None if b is None else clean(b)
        if not a.strip() or (b is not None and not b.strip()):
            skipped += 1
            if len(skipped_where) < _SHOW_SKIPPED:
                skipped_where.append(f"{t.name}:{t.where[r]}")
            continue
        y = _label(t, r, label_column, allowed)
        if id_column is not None:
            ex = _cell(t, r, id_column, _name)
            if ex is None:
                raise DataError(f"{t.loc(r)}: empty id in column {id_column!r}; expected a unique id per row")
            if ex in id_row:
                raise DataError(f"{t.loc(r)}: id {ex!r} in column {id_column!r} repeats the id of "
                                f"{t.unit} {t.where[id_row[ex]]}; expected a unique id per row")
            id_row[ex] = r
        else:
            ex = str(r)
        g = _cell(t, r, group_column, _name) if group_column is not None else None
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
                        f"{listed(skipped_where[:3])}); expected at least one row with text")
    class_names = t.class_names.get(label_column)
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
