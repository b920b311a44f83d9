"""cat_fast.bias.features: the tokeniser and the overlap features on hand-written pairs with known values."""
import math

import pytest
import torch

from cat_fast.bias import FEATURE_NAMES, NEGATION_WORDS, overlap_features, words


def test_words():
    assert words("Isn't it O'Neil\u2019s dog_house? 3.5 CATS!") == ["isn't", "it", "o'neil's", "dog", "house", "3", "5",
                                                                   "cats"]
    assert words("do n't go .") == ["do", "n't", "go"]
    assert words("  ... !") == []
    assert "n't" in NEGATION_WORDS and "not" in NEGATION_WORDS


# (premise, hypothesis) -> h_subsequence, h_all_in_p, h_fraction_in_p, log_length_difference, h_negation,
#                          p_fraction_in_h, log_h_length
CASES = [
    # HANS-style: the hypothesis is a contiguous run of the premise; p has 7 words, h 2
    ("The lawyers were helped by the athlete .", "The athlete .",
     [1, 1, 1, math.log(5), 0, 3 / 7, math.log(3)]),
    # negation ("nobody", "isn't"), one of 3 hypothesis words in the premise, len difference 1 -> log 1 = 0
    ("A man is sleeping.", "Nobody isn't sleeping!",
     [0, 0, 1 / 3, 0.0, 1, 1 / 4, math.log(4)]),
    # all words in the premise, but not contiguously; case does not matter
    ("the cat sat on the mat", "THE Cat the mat",
     [0, 1, 1, math.log(2), 0, 4 / 6, math.log(5)]),
    # repeated hypothesis words count each time; the hypothesis longer than the premise -> log 1
    ("a b c", "b b d e",
     [0, 0, 2 / 4, 0.0, 0, 1 / 3, math.log(5)]),
    # a hypothesis without words: 0 in the overlap features
    ("Dogs run.", "...",
     [0, 0, 0, math.log(2), 0, 0, 0.0]),
    # a curly apostrophe is an apostrophe: "don't" is a negation
    ("They sing.", "They don\u2019t sing.",
     [0, 0, 2 / 3, 0.0, 1, 1.0, math.log(4)]),
]


def test_known_values():
    X = overlap_features([c[0] for c in CASES], [c[1] for c in CASES])
    assert X.dtype == torch.float64 and X.shape == (len(CASES), len(FEATURE_NAMES)) == (6, 7)
    want = torch.tensor([c[2] for c in CASES], dtype=torch.float64)
    torch.testing.assert_close(X, want, rtol=0, atol=1e-15)


def test_empty_and_errors():
    assert overlap_features([], []).shape == (0, len(FEATURE_NAMES))
    assert overlap_features(["a"], ["a"], dtype=torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match="2 premises but 1 hypotheses"):
        overlap_features(["a", "b"], ["a"])
    with pytest.raises(TypeError, match="single string"):
        overlap_features("a b", "a")
    with pytest.raises(TypeError, match=r"hypotheses\[1\] is a NoneType"):
        overlap_features(["a", "b"], ["a", None])
