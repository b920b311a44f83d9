"""Bias predictions on disk: one JSON Lines file per split, rows keyed by example id.

Typical use::

    save_bias("bias/train.jsonl", train.ids, log_probs, train.label_names, meta={"bias": "overlap"}, data=train)
    b = load_bias("bias/train.jsonl", label_names=train.label_names, data=train)   # [N, C], rows in train's order

The format (UTF-8, one JSON object per line): line 1 is the header
``{"format": "cat_fast-bias", "version": 1, "label_names": [...], "n": N, "meta": {...}, "fingerprint": F}``;
each further line is ``{"id": "<example id>", "log_probs": [b_0, ..., b_{C-1}], "sha256": "...", "label": "..."}``
(natural-log probabilities in ``label_names`` order, written as float64 decimals). ``save_bias`` writes a temporary
file in the same folder and renames it over ``path``, so a reader sees the old file or the new one, never a part.

The fingerprint (written when ``save_bias`` is given ``data=``, the examples the predictions are for): per row, the
sha256 of the example's texts (`text_digest`) and its label name, so that an id (often a row number) is known to
mean the same example when the file is read for another run. It is kept per row, not as one hash of the file,
because a run may train on a subset of the split (few-shot, long-tail). F names the scheme (`FINGERPRINT`).

``load_bias`` checks everything and raises a ``ValueError`` (:class:`BiasFileError`) naming the file and the first
offending id: an id missing from the file or one the caller did not ask for (``extra="ignore"`` allows the latter),
a repeated id, a label set other than ``label_names`` (the same names in another order are permuted to the caller's
order), a row of the wrong length, a non-finite value, or a row whose logsumexp is not 0 within ``tol``. Given
``data=``, also ids whose texts or labels differ from the file's fingerprint, and a file without a fingerprint
(written before fingerprints, or without ``data=``): its ids cannot be checked, and an id keyed by row number that
means another example trains silently on another example's bias, so such a file is refused (writing it again with
``cat-fast bias fit`` adds the fingerprint); without ``data=`` nothing is checked.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["BIAS_FORMAT", "FINGERPRINT", "BiasFileError", "BiasPredictions", "text_digest", "save_bias", "read_bias",
           "load_bias"]

BIAS_FORMAT = "cat_fast-bias"
FINGERPRINT = "sha256 of the UTF-8 JSON [text, text_pair] and the label name, per row"
_VERSION = 1
_TOL = 1e-4


class BiasFileError(ValueError):
    """A bias file (or predictions to save) that is not what it should be; the message names the file and id."""


@dataclass
class BiasPredictions:
    """The content of a bias file: ids in file order, log-probabilities ``[N, C]`` (float64), label names, meta,
    and the fingerprint, per row in file order (None for a file without one): texts' digests and label names."""

    path: str
    ids: List[str]
    log_probs: torch.Tensor
    label_names: Tuple[str, ...]
    meta: Dict[str, Any] = field(default_factory=dict)
    digests: Optional[List[str]] = None
    labels: Optional[List[str]] = None


def text_digest(text: str, text_pair: Optional[str] = None) -> str:
    """The sha256 (hex) of an example's texts, as the fingerprint of a bias file stores it."""
    return hashlib.sha256(json.dumps([text, text_pair], ensure_ascii=False).encode("utf-8")).hexdigest()


def _fingerprint(data, where: str) -> Tuple[List[str], List[str], List[str]]:
    """(ids, text digests, label names) of `data` (a `cat_fast.data.CadData`: ids, text, text_pair, labels)."""
    try:
        pairs = data.text_pair if data.text_pair is not None else [None] * len(data.text)
        names = [data.label_names[y] for y in data.labels]
        return ([str(i) for i in data.ids], [text_digest(t, p) for t, p in zip(data.text, pairs)], names)
    except (AttributeError, TypeError, IndexError) as e:
        raise BiasFileError(f"{where}: data={type(data).__name__} ({e}); expected the examples (a CadData: ids, "
                            f"text, text_pair, labels, label_names)") from None


def _check_fingerprint(bp: BiasPredictions, fingerprint: Tuple[List[str], List[str], List[str]]) -> None:
    """Every id of the data (`_fingerprint`) means in the file what it means in the data: its texts and label."""
    if bp.digests is None:
        raise BiasFileError(f"{bp.path}: no fingerprint of the examples it was written for (a file from an older "
                            f"cat_fast, or saved without data=), so its ids cannot be checked against the training "
                            f"data; write it again (cat-fast bias fit)")
    row = {i: r for r, i in enumerate(bp.ids)}
    texts, labels = [], []
    for i, digest, name in zip(*fingerprint):
        if bp.digests[row[i]] != digest:
            texts.append(i)
        elif bp.labels[row[i]] != name:
            labels.append((i, bp.labels[row[i]], name))
    if texts or labels:
        parts = ([f"{len(texts)} have other texts (first: id {texts[0]!r})"] if texts else []) + (
            [f"{len(labels)} other labels (first: id {labels[0][0]!r}: {labels[0][1]!r} in the file, "
             f"{labels[0][2]!r} in the data)"] if labels else [])
        raise BiasFileError(f"{bp.path}: its rows differ from the training data's: of {len(fingerprint[0])} id(s), "
                            f"{' and '.join(parts)}; a bias file for another or reordered training file? (fit it "
                            f"again on this data: cat-fast bias fit)")


def _label_names(names, where: str) -> Tuple[str, ...]:
    if isinstance(names, str) or names is None:
        raise BiasFileError(f"{where}: label_names={names!r}; expected a sequence of label names")
    names = tuple(names)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise BiasFileError(f"{where}: label_names {list(names)!r}; expected non-empty strings")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise BiasFileError(f"{where}: label name(s) {', '.join(map(repr, dup))} repeated; expected each label once")
    return names


def _check_rows(lp: torch.Tensor, ids: Sequence[str], where: str, tol: float) -> None:
    """Every row finite and normalised (|logsumexp| <= tol); the error names the first bad row's id."""
    bad_finite = ~torch.isfinite(lp).all(1)
    if bad_finite.any():
        i = int(bad_finite.nonzero()[0])
        raise BiasFileError(f"{where}: id {ids[i]!r}: log-probabilities {lp[i].tolist()} are not all finite; "
                            f"expected finite natural-log probabilities")
    lse = torch.logsumexp(lp, 1)
    bad_norm = lse.abs() > tol
    if bad_norm.any():
        i = int(bad_norm.nonzero()[0])
        raise BiasFileError(f"{where}: id {ids[i]!r}: log-probabilities {lp[i].tolist()} are not normalised "
                            f"(logsumexp {float(lse[i]):.3g}, expected 0 within {tol:g}); expected log-softmax "
                            f"outputs")


def save_bias(path, ids: Sequence[str], log_probs: torch.Tensor, label_names: Sequence[str],
              meta: Optional[Dict[str, Any]] = None, tol: float = _TOL, *, data=None) -> str:
    """Write bias log-probabilities ``[N, C]`` of the examples ``ids`` (strings, unique) to ``path`` atomically.

    The rows are checked as :func:`load_bias` will check them (finite, normalised within ``tol``); ``meta`` is any
    JSON-serialisable dict (what made the predictions). ``data``: the examples themselves (a CadData whose ids are
    ``ids``, in order): their fingerprint goes into the file, for ``load_bias(..., data=)``. Returns ``path``.
    """
    if data is not None:
        data_ids, digests, row_labels = _fingerprint(data, f"save_bias({os.fspath(path)})")
        if data_ids != [i if isinstance(i, str) else str(i) for i in ids]:
            raise BiasFileError(f"save_bias({os.fspath(path)}): data's ids are not ids; expected the examples of "
                                f"ids, in that order")
    path = os.fspath(path)
    where = f"save_bias({path})"
    names = _label_names(label_names, where)
    ids = [i if isinstance(i, str) else str(i) for i in ids]
    lp = torch.as_tensor(log_probs).detach().to("cpu", torch.float64)
    if lp.dim() != 2 or lp.shape[1] != len(names) or lp.shape[0] != len(ids):
        raise BiasFileError(f"{where}: log_probs has shape {tuple(lp.shape)}; expected [{len(ids)}, {len(names)}] "
                            f"(one row per id, one column per label: {', '.join(names)})")
    seen = set()
    for i in ids:
        if not i:
            raise BiasFileError(f"{where}: an empty id; expected a non-empty id per example")
        if i in seen:
            raise BiasFileError(f"{where}: id {i!r} repeated; expected unique example ids")
        seen.add(i)
    _check_rows(lp, ids, where, tol)
    header = {"format": BIAS_FORMAT, "version": _VERSION, "label_names": list(names), "n": len(ids),
              "meta": {} if meta is None else meta}
    if data is not None:
        header["fingerprint"] = FINGERPRINT
    try:
        head = json.dumps(header, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise BiasFileError(f"{where}: meta cannot be written as JSON ({e}); expected a dict of JSON values") from None
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(head + "\n")
            for r, (i, row) in enumerate(zip(ids, lp.tolist())):
                line = {"id": i, "log_probs": row}
                if data is not None:
                    line.update(sha256=digests[r], label=row_labels[r])
                f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would outlive the rename
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def read_bias(path, tol: float = _TOL) -> BiasPredictions:
    """Everything in a bias file, rows in file order, checked (see the module docstring)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise BiasFileError(f"{path}: bias file not found")
    header: Optional[Dict[str, Any]] = None
    ids: List[str] = []
    rows: List[List[float]] = []
    line_of: Dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BiasFileError(f"{path}: line {n}: not valid JSON ({e.msg}); expected a cat_fast bias file "
                                    f"(JSON Lines)") from None
            if header is None:
                if not (isinstance(obj, dict) and obj.get("format") == BIAS_FORMAT):
                    raise BiasFileError(f"{path}: line {n}: not a cat_fast bias file header; expected "
                                        f"{{\"format\": \"{BIAS_FORMAT}\", \"label_names\": [...], ...}}")
                if obj.get("version") != _VERSION:
                    raise BiasFileError(f"{path}: format version {obj.get('version')!r}; this cat_fast reads "
                                        f"version {_VERSION}")
                header = obj
                names = _label_names(obj.get("label_names"), path)
                if obj.get("fingerprint") not in (None, FINGERPRINT):
                    raise BiasFileError(f"{path}: fingerprint {obj['fingerprint']!r}; this cat_fast reads "
                                        f"{FINGERPRINT!r}")
                digests, labels = ([], []) if obj.get("fingerprint") else (None, None)
                continue
            if not (isinstance(obj, dict) and isinstance(obj.get("id"), str) and isinstance(obj.get("log_probs"), list)):
                raise BiasFileError(f"{path}: line {n}: expected {{\"id\": \"...\", \"log_probs\": [...]}}")
            i, row = obj["id"], obj["log_probs"]
            if i in line_of:
                raise BiasFileError(f"{path}: id {i!r} repeated (lines {line_of[i]} and {n}); expected unique ids")
            if len(row) != len(names) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in row):
                raise BiasFileError(f"{path}: id {i!r} (line {n}): log_probs {row!r}; expected {len(names)} numbers "
                                    f"({', '.join(names)})")
            if digests is not None:
                if not (isinstance(obj.get("sha256"), str) and isinstance(obj.get("label"), str)):
                    raise BiasFileError(f"{path}: id {i!r} (line {n}): no fingerprint; expected \"sha256\" and "
                                        f"\"label\" strings, as the header's \"fingerprint\" says")
                digests.append(obj["sha256"])
                labels.append(obj["label"])
            line_of[i] = n
            ids.append(i)
            rows.append([float(v) for v in row])
    if header is None:
        raise BiasFileError(f"{path}: empty file; expected a cat_fast bias file (a header line, then one row per id)")
    if "n" in header and header["n"] != len(ids):
        raise BiasFileError(f"{path}: {len(ids)} rows but the header says n={header['n']} (a truncated file?)")
    lp = torch.tensor(rows, dtype=torch.float64).reshape(len(ids), len(names))
    _check_rows(lp, ids, path, tol)
    meta = header.get("meta") or {}
    return BiasPredictions(path, ids, lp, names, meta if isinstance(meta, dict) else {"meta": meta}, digests, labels)


def load_bias(path, ids: Optional[Sequence[str]] = None, label_names: Optional[Sequence[str]] = None, *,
              extra: str = "error", dtype: torch.dtype = torch.float32, tol: float = _TOL, data=None) -> torch.Tensor:
    """Bias log-probabilities ``[N, C]`` from ``path``, rows aligned to ``ids`` (default: file order), columns to
    ``label_names`` (default: the file's).

    ``ids``: the examples' ids (e.g. ``data.ids``; a :class:`~cat_fast.data.CadData` is taken as its ``ids``).
    Every id must be in the file; an id in the file that is not in ``ids`` is an error unless ``extra="ignore"``.
    ``label_names``: the same label set as the file's; another order permutes the columns.
    ``data``: the examples (a CadData; instead of ``ids``, which become its ids): each one's texts and label must
    be those the file's fingerprint holds for its id (module docstring).
    """
    if extra not in ("error", "ignore"):
        raise ValueError(f"load_bias: extra={extra!r}; expected 'error' or 'ignore'")
    if data is not None and ids is not None:
        raise ValueError("load_bias: ids= and data= both given; expected one (data= aligns the rows to its ids)")
    bp = read_bias(path, tol=tol)
    lp = bp.log_probs
    if label_names is not None:
        want = _label_names(label_names, f"load_bias({bp.path})")
        if set(want) != set(bp.label_names) or len(want) != len(bp.label_names):
            raise BiasFileError(f"{bp.path}: labels {', '.join(bp.label_names)}; expected {', '.join(want)} (the "
                                f"main task's label set)")
        lp = lp[:, [bp.label_names.index(n) for n in want]]
    fingerprint = None if data is None else _fingerprint(data, f"load_bias({bp.path})")
    if fingerprint is not None:
        ids = fingerprint[0]
    if ids is not None:
        ids = [i if isinstance(i, str) else str(i) for i in getattr(ids, "ids", ids)]
        row = {i: r for r, i in enumerate(bp.ids)}
        missing = [i for i in ids if i not in row]
        if missing:
            raise BiasFileError(f"{bp.path}: id {missing[0]!r} not in the file ({len(missing)} of {len(ids)} id(s) "
                                f"missing); expected a row for every example")
        seen = set()
        for i in ids:
            if i in seen:
                raise BiasFileError(f"load_bias({bp.path}): id {i!r} requested twice; expected unique ids")
            seen.add(i)
        if extra == "error" and len(ids) != len(bp.ids):
            wanted = set(ids)
            first = next(i for i in bp.ids if i not in wanted)
            raise BiasFileError(f"{bp.path}: id {first!r} is not one of the {len(ids)} example(s) asked for "
                                f"({len(bp.ids) - len(ids)} extra row(s)); a bias file for another split? "
                                f"(extra='ignore' to allow)")
        if fingerprint is not None:
            _check_fingerprint(bp, fingerprint)
        lp = lp[[row[i] for i in ids]]
    return lp.to(dtype)

