"""Hand-crafted word-overlap features of premise/hypothesis pairs, for the overlap bias model (docs/METHODS.md §4).

``overlap_features(premises, hypotheses)`` returns a float64 tensor ``[N, F]``, columns named by
:data:`FEATURE_NAMES`. Texts are tokenised by :func:`words`: lower-cased, then every maximal run of letters and
digits, with inner apostrophes kept (``isn't``, ``n't``, ``o'clock``; ``’`` counts as ``'``); punctuation and
underscores are dropped. With ``p`` the premise's words, ``h`` the hypothesis's and ``P`` / ``H`` their sets:

0. ``h_subsequence``: ``h`` occurs contiguously in ``p``                                 (Clark et al. 2019)
1. ``h_all_in_p``: every word of ``h`` is in ``P``                                       (Clark et al. 2019)
2. ``h_fraction_in_p``: the fraction of the words of ``h`` (with repeats) that are in ``P`` (Clark et al. 2019)
3. ``log_length_difference``: ``log(max(len(p) − len(h), 1))``                           (Clark et al. 2019)
4. ``h_negation``: ``h`` holds a negation word (:data:`NEGATION_WORDS`, or a word ending in ``n't``)
5. ``p_fraction_in_h``: the fraction of the words of ``p`` that are in ``H``
6. ``log_h_length``: ``log(1 + len(h))``

0–3 are the released code's non-embedding features (``build_mnli_bias_only.py``); its three fastText similarity
features (mean, minimum and second minimum over hypothesis words of the best cosine similarity to a premise word,
``crawl-300d-2M``) need word vectors that are not available offline, so they are left out. 4 is asked for by the
project's issue (the released code has no negation feature); 5–6 are simple extras. A hypothesis without words gets
0 in features 0–2 (a premise without words: 0 in feature 5).
"""
from __future__ import annotations

import math
import re
from typing import List, Sequence

import torch

__all__ = ["FEATURE_NAMES", "NEGATION_WORDS", "words", "overlap_features"]

FEATURE_NAMES = ("h_subsequence", "h_all_in_p", "h_fraction_in_p", "log_length_difference", "h_negation",
                 "p_fraction_in_h", "log_h_length")
NEGATION_WORDS = frozenset({"not", "no", "never", "nobody", "nothing", "none", "nowhere", "neither", "nor",
                            "cannot", "n't"})
_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")


def words(text: str) -> List[str]:
    """The lower-cased words of ``text`` (runs of letters and digits; inner apostrophes kept)."""
    return _WORD.findall(text.lower().replace("\u2019", "'"))


def _is_subsequence(needle: List[str], haystack: List[str]) -> bool:
    k = len(needle)
    return 0 < k <= len(haystack) and any(haystack[i:i + k] == needle for i in range(len(haystack) - k + 1))


def _negated(ws: List[str]) -> bool:
    return any(w in NEGATION_WORDS or w.endswith("n't") for w in ws)


def _row(premise: str, hypothesis: str) -> List[float]:
    p, h = words(premise), words(hypothesis)
    p_set, h_set = set(p), set(h)
    h_in_p = sum(w in p_set for w in h)
    return [
        float(_is_subsequence(h, p)),
        float(bool(h) and h_in_p == len(h)),
        h_in_p / len(h) if h else 0.0,
        math.log(max(len(p) - len(h), 1)),
        float(_negated(h)),
        sum(w in h_set for w in p) / len(p) if p else 0.0,
        math.log1p(len(h)),
    ]


def overlap_features(premises: Sequence[str], hypotheses: Sequence[str], dtype: torch.dtype = torch.float64
                     ) -> torch.Tensor:
    """Features ``[N, len(FEATURE_NAMES)]`` of ``N`` premise/hypothesis pairs (see the module docstring)."""
    if isinstance(premises, str) or isinstance(hypotheses, str):
        raise TypeError("overlap_features: expected sequences of texts (premises, hypotheses), got a single string")
    premises, hypotheses = list(premises), list(hypotheses)
    if len(premises) != len(hypotheses):
        raise ValueError(f"overlap_features: {len(premises)} premises but {len(hypotheses)} hypotheses; expected "
                         f"one hypothesis per premise")
    for name, texts in (("premises", premises), ("hypotheses", hypotheses)):
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(f"overlap_features: {name}[{bad}] is a {type(texts[bad]).__name__}; expected a string")
    rows = [_row(p, h) for p, h in zip(premises, hypotheses)]
    return torch.tensor(rows, dtype=dtype).reshape(len(rows), len(FEATURE_NAMES))
