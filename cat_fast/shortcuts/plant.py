"""Plant a known shortcut in labelled text data: a surface cue that predicts one class in training and dev, is
anti-correlated with it in one test set and absent from another (``cat-fast shortcut plant``).

    from cat_fast.shortcuts import parse_cue, plant
    result = plant(train, parse_cue("token:zeugma@start"), strength=0.9, cue_class=0, seed=0)
    result.splits["test_anti"][0]   # {"id": ..., "text": ..., "label": "Negative", "cue": 0}

Cues (``parse_cue``), applied to the text of one field (``text``, or ``text_pair`` for text pairs) of a row that
carries the cue; a row without it is left as it is unless the kind says otherwise:

* ``token:WORD[@start|@end|@random]``: the word or phrase WORD (one space each side) before the text (``@start``, the
  default), after it (``@end``) or between two of its whitespace-separated words at a position drawn uniformly
  from the row's 0..n gaps (``@random``; the words are then joined by single spaces). Rows that hold WORD already
  (case-insensitive, as a whole word) would make the cue noisy: more than :data:`MAX_PRESENT` of the input rows is
  refused, fewer is a warning (``PlantResult.warnings``).
* ``length[:N]``: N (default 3) copies of the neutral :data:`FILLER` sentence appended, so that longer texts predict
  the class. The filler's words are part of the cue as much as the added length.
* ``punctuation``: the text's trailing run of ``.``, ``!``, ``?``, ``…`` removed, then ``!!`` appended with the cue
  and ``.`` without it. Every row of every split, ``test_clean`` included, gets one of the two endings, so the
  text's own ending carries no signal.
* ``casing[:K]``: the first K (default 3) words upper-cased; ``casing:0``: the whole text. A tokenizer that
  lower-cases (uncased BERT vocabularies, MiniLM) cannot see this cue.

Strength P in [0.5, 1] and the cue class c (one label; the cue is binary, for any number of classes): in train and
dev, exactly round(P·n_c) of the n_c rows of class c carry the cue and exactly round((1−P)·n_k) of the n_k rows of
every other class k (halves rounded up; which rows: drawn with the seed), so P(cue | y=c) ≈ P and P(cue | y≠c) ≈
1−P. ``test_anti``: the cue on every row not of class c and on none of class c. ``test_clean`` and ``train_clean``
(the rows of train): no cue.

Splits: ``train`` from the training input; ``dev`` and the test rows from their own inputs where given, else held
out of the training input by counterfactual group (a group's rows stay together; fractions of the training input's
rows, rounded up to whole groups). ``test_anti`` and ``test_clean`` hold the same rows. Every draw is made by
``random.Random`` seeded from the seed and the split's name, so one seed gives the same files.

Rows: ``id`` (the input's), ``text`` [``text_pair``], ``label`` (its name), ``cue`` (0/1) and, when the training
input has counterfactual groups, ``group`` in every split (the input's group id).
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

__all__ = ["Cue", "CUE_FORMS", "FILLER", "MAX_PRESENT", "ShortcutError", "PlantResult", "parse_cue", "apply_cue",
           "kept_before_ending", "assign_cue", "hold_out", "rows_with", "cue_statistics", "plant"]

CUE_FORMS = "token:WORD[@start|@end|@random], length[:N], punctuation or casing[:K]"
FILLER = "This sentence was added to the text."
MAX_PRESENT = 0.01  # a token cue already in more than this fraction of the input rows is refused
POSITIONS = ("start", "end", "random")
_ENDING = re.compile(r"[.!?…]+$")


class ShortcutError(ValueError):
    """A planting request that cannot be met (one line); ``split``: the split it concerns (train, dev, test), if
    one."""

    def __init__(self, message: str, split: Optional[str] = None):
        super().__init__(message)
        self.split = split


@dataclass(frozen=True)
class Cue:
    """One cue: its ``kind`` (token, length, punctuation, casing), the ``token`` and its ``position`` (token), and
    ``count``: filler sentences (length) or upper-cased words (casing, 0 = the whole text)."""

    kind: str
    token: Optional[str] = None
    position: str = "start"
    count: int = 3

    @property
    def spec(self) -> str:
        if self.kind == "token":
            return f"token:{self.token}@{self.position}"
        return self.kind if self.kind == "punctuation" else f"{self.kind}:{self.count}"

    @property
    def at_end(self) -> bool:
        """Whether the cue sits at the end of the text (punctuation, length, ``token:WORD@end``), where truncation
        cuts it."""
        return self.kind in ("punctuation", "length") or (self.kind == "token" and self.position == "end")


def parse_cue(spec: str) -> Cue:
    """``token:WORD[@POSITION]``, ``length[:N]``, ``punctuation`` or ``casing[:K]`` -> a :class:`Cue`."""
    kind, sep, rest = spec.partition(":")
    if kind == "token":
        token, at, position = rest.rpartition("@") if "@" in rest else (rest, "", "start")
        token = " ".join(token.split())
        if not token or (at and position not in POSITIONS):
            raise ShortcutError(f"expected {CUE_FORMS}, got {spec!r}")
        return Cue("token", token=token, position=position)
    if kind in ("length", "casing"):
        low = 1 if kind == "length" else 0
        if not sep:
            return Cue(kind)
        if rest.isdigit() and int(rest) >= low:
            return Cue(kind, count=int(rest))
        raise ShortcutError(f"expected {kind}[:{'N' if low else 'K'}] with an integer >= {low}, got {spec!r}")
    if spec == "punctuation":
        return Cue("punctuation")
    raise ShortcutError(f"expected {CUE_FORMS}, got {spec!r}")


def apply_cue(cue: Cue, text: str, present: bool, rng: random.Random) -> str:
    """`text` with the cue (``present``) or as a row without it reads (`rng`: the ``@random`` position)."""
    if cue.kind == "punctuation":
        return kept_before_ending(cue, text) + ("!!" if present else ".")
    if not present:
        return text
    if cue.kind == "token":
        if cue.position == "start":
            return f"{cue.token} {text.lstrip()}"
        if cue.position == "end":
            return f"{text.rstrip()} {cue.token}"
        words = text.split()
        k = rng.randint(0, len(words))
        return " ".join(words[:k] + [cue.token] + words[k:])
    if cue.kind == "length":
        return " ".join([text.rstrip()] + [FILLER] * cue.count)
    if cue.count == 0:  # casing
        return text.upper()
    parts = re.split(r"(\s+)", text)
    seen = 0
    for i, part in enumerate(parts):
        if part and not part.isspace():
            if seen == cue.count:
                break
            parts[i] = part.upper()
            seen += 1
    return "".join(parts)


def kept_before_ending(cue: Cue, text: str) -> str:
    """What an end-of-text cue keeps of `text` before its ending: the text without trailing whitespace, and for
    punctuation also without its trailing run of ``.``, ``!``, ``?``, ``…`` (which the cue replaces)."""
    text = text.rstrip()
    return _ENDING.sub("", text).rstrip() if cue.kind == "punctuation" else text


def rows_with(token: str, texts: Sequence[str]) -> int:
    """How many of `texts` hold `token` as a whole word or phrase, ignoring case."""
    pattern = re.compile(r"(?<!\w)" + r"\s+".join(re.escape(w) for w in token.split()) + r"(?!\w)", re.IGNORECASE)
    return sum(1 for t in texts if pattern.search(t))


def _round(x: float) -> int:
    return int(math.floor(x + 0.5))


def assign_cue(labels: Sequence[int], cue_class: int, strength: float, rng: random.Random) -> List[int]:
    """0/1 per row: round(P·n) of the class-`cue_class` rows and round((1−P)·n_k) of every other class's rows."""
    flags = [0] * len(labels)
    for k in sorted(set(labels)):
        rows = [i for i, y in enumerate(labels) if y == k]
        share = strength if k == cue_class else 1.0 - strength
        for i in rng.sample(rows, _round(share * len(rows))):
            flags[i] = 1
    return flags


def hold_out(data, fractions: Sequence[float], rng: random.Random) -> List[List[int]]:
    """Row indices of `data` (a CadData) cut by whole counterfactual groups, shuffled by `rng`: one part per
    fraction (at least round(fraction·n) rows each, rounded up to whole groups), then the rest; each part in the
    input's order."""
    groups = list(data.groups)
    rng.shuffle(groups)
    parts: List[List[int]] = []
    for fraction in fractions:
        want, part = _round(fraction * len(data)), []
        while groups and len(part) < want:
            part.extend(groups.pop(0))
        parts.append(sorted(part))
    parts.append(sorted(i for g in groups for i in g))
    return parts


def cue_statistics(rows: Sequence[Dict], labels: Sequence[str]) -> Dict:
    """Per split: rows, rows with the cue, and per label its rows, cue rows and P(cue | label)."""
    out = {"n": len(rows), "cue": sum(r["cue"] for r in rows), "labels": {}}
    for name in labels:
        mine = [r for r in rows if r["label"] == name]
        cue = sum(r["cue"] for r in mine)
        out["labels"][name] = {"n": len(mine), "cue": cue, "p_cue": cue / len(mine) if mine else None}
    return out


@dataclass
class PlantResult:
    """The planted splits (``train``, ``train_clean``, ``dev``, ``test_anti``, ``test_clean``: lists of row dicts),
    their :func:`cue_statistics` and any warnings."""

    splits: Dict[str, List[Dict]]
    statistics: Dict[str, Dict]
    warnings: List[str] = field(default_factory=list)


SPLITS = ("train", "train_clean", "dev", "test_anti", "test_clean")


def plant(train, cue: Cue, strength: float, cue_class: int, seed: int, field: str = "text", dev=None, test=None,
          dev_fraction: float = 0.1, test_fraction: float = 0.2) -> PlantResult:
    """Plant `cue` in CadData inputs (module docstring); `dev` / `test`: their own inputs, else held out of `train`
    (`dev_fraction`, `test_fraction` of its rows). Raises :class:`ShortcutError` on a request it cannot meet."""
    if not 0.5 <= strength <= 1.0:
        raise ShortcutError(f"the strength must be in [0.5, 1], got {strength}")
    if field not in ("text", "text_pair"):
        raise ShortcutError(f"the cue field is text or text_pair, got {field!r}")
    if field == "text_pair" and train.text_pair is None:
        raise ShortcutError("the cue field text_pair needs text pairs; these data have single texts")
    labels = list(train.label_names)
    if not 0 <= cue_class < len(labels):
        raise ShortcutError(f"cue class {cue_class} is not a label id of 0..{len(labels) - 1}")
    inputs = [d for d in (train, dev, test) if d is not None]
    warnings = _check_token(cue, inputs, field)
    carve = [f for f, given in ((test_fraction, test), (dev_fraction, dev)) if given is None]
    parts = hold_out(train, carve, random.Random(f"{seed}:hold-out")) if carve else [list(range(len(train)))]
    rest = list(parts)
    test_rows = (test, list(range(len(test)))) if test is not None else (train, rest.pop(0))
    dev_rows = (dev, list(range(len(dev)))) if dev is not None else (train, rest.pop(0))
    sources = {"train": (train, rest[0]), "dev": dev_rows, "test": test_rows}
    for name, (data, rows) in sources.items():
        ys = {data.labels[i] for i in rows}
        if not rows:
            raise ShortcutError(f"the {name} split is empty; it needs rows of the cue class and of another class",
                                split=name)
        if cue_class not in ys or not ys - {cue_class}:
            raise ShortcutError(f"the {name} split's {len(rows)} rows are {'none' if cue_class not in ys else 'all'} "
                                f"of the cue class {labels[cue_class]!r}; it needs rows of the cue class and of "
                                "another class", split=name)
    grouped = any(len(g) > 1 for g in train.groups)  # then every split has a group column (gs, cat: --group-column)
    splits = {}

    def write(name, data, rows, flags):
        rng = random.Random(f"{seed}:{name}:position")
        splits[name] = [_row(data, i, flag, cue, field, rng, grouped) for i, flag in zip(rows, flags)]

    for name, (data, rows) in sources.items():
        ys = [data.labels[i] for i in rows]
        if name == "test":
            write("test_anti", data, rows, [int(y != cue_class) for y in ys])
            write("test_clean", data, rows, [0] * len(rows))
            continue
        write(name, data, rows, assign_cue(ys, cue_class, strength, random.Random(f"{seed}:{name}:cue")))
        if name == "train":
            write("train_clean", data, rows, [0] * len(rows))
    splits = {name: splits[name] for name in SPLITS}
    return PlantResult(splits, {n: cue_statistics(r, labels) for n, r in splits.items()}, warnings)


def _check_token(cue: Cue, inputs, field: str) -> List[str]:
    if cue.kind != "token":
        return []
    texts = [t for d in inputs for t in getattr(d, field)]
    found = rows_with(cue.token, texts)
    if found > MAX_PRESENT * len(texts):
        raise ShortcutError(f"the cue token {cue.token!r} is already in {found} of the {len(texts)} input rows "
                            f"(more than {MAX_PRESENT:.0%}); choose a word the data does not use")
    if found:
        return [f"the cue token {cue.token!r} is already in {found} of the {len(texts)} input rows; they count as "
                "rows without the cue"]
    return []


def _row(data, i: int, flag: int, cue: Cue, field: str, rng: random.Random, grouped: bool) -> Dict:
    row = {"id": data.ids[i], "text": data.text[i]}
    if data.text_pair is not None:
        row["text_pair"] = data.text_pair[i]
    row[field] = apply_cue(cue, row[field], bool(flag), rng)
    row["label"] = data.label_names[data.labels[i]]
    row["cue"] = int(flag)
    if grouped:
        row["group"] = data.group[i]
    return row
