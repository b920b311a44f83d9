"""Texts cut to the truncation length before a cue at the end of the text is planted (``cat-fast shortcut plant
--fit-max-length``), so that the model trained at that length sees the cue on every row that carries it.

    from cat_fast.shortcuts import fit_data, parse_cue
    data, summary = fit_data(data, parse_cue("punctuation"), tokenizer, max_length=128)

Each row's cue field (``text`` or ``text_pair``) is cut after its last whole word (words: runs of non-whitespace; the
cut text is a prefix of the original ending at a word's end) so that the row as the model reads it (the pair
together, special tokens included) fits in ``max_length`` tokens with the longest ending the cue can give it (``!!``
or ``.``, the filler sentences, the token). Rows that fit already are left as they are. A row keeps at least one
word; one that does not fit even then (the other text of the pair alone is too long) is counted as ``unfit``.

One pass of the tokenizer finds where to cut (a fast tokenizer's offsets; a slow one: each word's tokens), then every
row is tokenized with the cue to check, and the few the estimate missed (a tokenizer whose tokens of a text are not
those of its words) lose more words.
"""
from __future__ import annotations

import bisect
import dataclasses
import random
import re
from typing import Dict, List, Optional, Sequence, Tuple

from .plant import Cue, apply_cue, kept_before_ending

__all__ = ["Fitted", "fit_to_length", "fit_data"]

_WORD = re.compile(r"\S+")
_RNG = random.Random(0)  # apply_cue's rng, drawn from only by token:WORD@random, which is never fitted


@dataclasses.dataclass
class Fitted:
    """The cue field's texts after :func:`fit_to_length`, the words cut from each row, and the rows that hold one
    word and still do not fit."""

    texts: List[str]
    words_removed: List[int]
    unfit: List[int]

    def summary(self) -> Dict:
        cut = [w for w in self.words_removed if w]
        return {"rows": len(self.texts), "rows_cut": len(cut),
                "mean_words_removed": round(sum(cut) / len(cut), 2) if cut else 0.0, "unfit": len(self.unfit)}


def _pairs(texts, others, field: str):
    return (texts, others) if field == "text" else (others, texts)


def _lengths(tokenizer, cue: Cue, texts: Sequence[str], others, field: str) -> List[int]:
    """Per row, its tokens as the model reads it with the longer of the cue's endings: with it, and for punctuation
    also without it ('.'; without a token or length cue a row is its text, shorter than with it)."""
    if not texts:
        return []
    longest = [0] * len(texts)
    for present in (True, False) if cue.kind == "punctuation" else (True,):
        first, second = _pairs([apply_cue(cue, t, present, _RNG) for t in texts], others, field)
        ids = tokenizer(first, second, verbose=False)["input_ids"]
        longest = [max(n, len(i)) for n, i in zip(longest, ids)]
    return longest


def _token_starts(tokenizer, texts: Sequence[str], others, field: str) -> Tuple[List[int], List[List[int]]]:
    """Per row, its tokens as the model reads it (no cue) and where in the cue field each of the field's tokens
    starts: a fast tokenizer's offsets, else each word's start once per token of the word alone (then an ending the
    punctuation cue replaces inside a word counts as kept, and such a cut may keep a word fewer than would fit)."""
    first, second = _pairs(texts, others, field)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(first, second, return_offsets_mapping=True, verbose=False)
        side = 0 if field == "text" else 1
        starts = [[s for (s, _), q in zip(enc["offset_mapping"][r], enc.sequence_ids(r)) if q == side]
                  for r in range(len(texts))]
        return [len(ids) for ids in enc["input_ids"]], starts
    totals = [len(ids) for ids in tokenizer(first, second, verbose=False)["input_ids"]]
    words = [list(_WORD.finditer(t)) for t in texts]
    flat = [m.group() for ms in words for m in ms]
    counts = iter([len(ids) for ids in tokenizer(flat, add_special_tokens=False)["input_ids"]] if flat else [])
    return totals, [[m.start() for m in ms for _ in range(next(counts))] for ms in words]


def _estimate(cue: Cue, text: str, fixed: int, starts: List[int], ends: List[int], budget: int) -> int:
    """The most words of `text` (at least one) whose cut fits in `budget` tokens: `fixed` (the row's tokens outside
    the cue field, and the cue's longest ending) and the field's tokens that start before the end of what the cue
    keeps of the cut (all of it, less the ending punctuation replaces); a binary search over the word ends."""
    low, high = 1, len(ends)
    while low < high:
        mid = (low + high + 1) // 2
        kept = len(kept_before_ending(cue, text[:ends[mid - 1]]))
        if fixed + bisect.bisect_left(starts, kept) <= budget:
            low = mid
        else:
            high = mid - 1
    return low


def fit_to_length(texts: Sequence[str], others: Optional[Sequence[str]], cue: Cue, tokenizer, max_length: int,
                  field: str = "text") -> Fitted:
    """`texts` (the cue field of each row; `others`: the other text of each pair, or None) cut to fit in
    `max_length` tokens of `tokenizer` with `cue`'s longest ending (module docstring). `field`: ``"text"`` (`texts`
    come first in the pair) or ``"text_pair"``."""
    if field not in ("text", "text_pair"):
        raise ValueError(f"the cue field is text or text_pair, got {field!r}")
    texts = list(texts)
    ends = [[m.end() for m in _WORD.finditer(t)] for t in texts]
    suffix = max(len(tokenizer(apply_cue(cue, "", p, _RNG), add_special_tokens=False)["input_ids"])
                 for p in (True, False))
    totals, starts = _token_starts(tokenizer, texts, others, field) if texts else ([], [])
    keep = [_estimate(cue, t, n + suffix - len(s), s, e, max_length) if e else 0
            for t, n, s, e in zip(texts, totals, starts, ends)]
    out, unfit = list(texts), []
    over = [r for r, e in enumerate(ends) if e]
    while over:  # the estimate checked with the cue; a row still too long loses at least as many tokens as it has over
        for r in over:
            out[r] = texts[r][:ends[r][keep[r] - 1]] if keep[r] < len(ends[r]) else texts[r]
        lengths = _lengths(tokenizer, cue, [out[r] for r in over], _some(others, over), field)
        still = [(r, n - max_length) for r, n in zip(over, lengths) if n > max_length]
        unfit += [r for r, _ in still if keep[r] == 1]
        over = [r for r, _ in still if keep[r] > 1]
        for r, excess in still:
            kept = bisect.bisect_left(starts[r], ends[r][keep[r] - 1])  # the field's tokens in the kept words
            first_gone = kept - excess
            fewer = bisect.bisect_right(ends[r], starts[r][first_gone]) if first_gone >= 0 else 1
            keep[r] = max(1, min(keep[r] - 1, fewer))
    return Fitted(out, [len(e) - k for e, k in zip(ends, keep)], sorted(unfit))


def _some(others, rows):
    return None if others is None else [others[r] for r in rows]


def fit_data(data, cue: Cue, tokenizer, max_length: int, field: str = "text"):
    """`data` (a CadData) with its `field` cut by :func:`fit_to_length` (a new CadData; ids, labels and groups as
    they were), and :meth:`Fitted.summary`."""
    others = None if data.text_pair is None else (data.text_pair if field == "text" else data.text)
    fitted = fit_to_length(getattr(data, field), others, cue, tokenizer, max_length, field=field)
    return dataclasses.replace(data, **{field: fitted.texts}), fitted.summary()
