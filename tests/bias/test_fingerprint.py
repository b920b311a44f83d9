"""The fingerprint of a bias file: `save_bias(..., data=)` stores each example's texts' digest and label per id, and
`load_bias(..., data=)` refuses a file whose ids mean other examples (a shuffled or different training file), or a
file without a fingerprint."""
import json

import pytest
import torch

from cat_fast import bias as B
from cat_fast.data import CadData


def nli(order=(0, 1, 2, 3), labels=(0, 2, 1, 0)):
    """Four NLI examples, keyed by row number (the default ids), in the given row order."""
    premises, hypotheses = ["p0", "p1", "p2", "p3"], ["h0", "h1", "h2", "h3"]
    return CadData("nli", [premises[i] for i in order], [hypotheses[i] for i in order], [labels[i] for i in order],
                   [True] * 4, list(range(4)))


def log_probs(n=4):
    return torch.log_softmax(torch.randn(n, 3, generator=torch.Generator().manual_seed(0)), 1)


def message(fn, *a, **k):
    with pytest.raises(ValueError) as e:
        fn(*a, **k)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_the_same_data_loads_and_a_subset_too(tmp_path):
    d, lp = nli(), log_probs()
    path = B.save_bias(tmp_path / "b.jsonl", d.ids, lp, d.label_names, data=d)
    rows = [json.loads(x) for x in open(path)]
    assert rows[0]["fingerprint"] == B.FINGERPRINT
    assert rows[1]["sha256"] == B.text_digest("p0", "h0") and rows[2]["label"] == "contradiction"
    assert torch.equal(B.load_bias(path, label_names=d.label_names, data=d), lp)
    few = d.subset([3, 1])  # a few-shot subset keeps its ids
    assert torch.equal(B.load_bias(path, data=few, extra="ignore"), lp[[3, 1]])
    assert B.read_bias(path).labels == ["entailment", "contradiction", "neutral", "entailment"]


def test_a_shuffled_training_file_is_refused(tmp_path):
    d, lp = nli(), log_probs()
    path = B.save_bias(tmp_path / "b.jsonl", d.ids, lp, d.label_names, data=d)
    shuffled = nli(order=(1, 0, 2, 3))  # row numbers 0 and 1 now mean other examples
    msg = message(B.load_bias, path, label_names=d.label_names, data=shuffled)
    assert str(path) in msg and "rows differ" in msg and "of 4 id(s), 2 have other texts (first: id '0')" in msg
    relabelled = nli(labels=(0, 2, 1, 1))
    msg = message(B.load_bias, path, data=relabelled)
    assert "1 other labels (first: id '3': 'entailment' in the file, 'neutral' in the data)" in msg
    other_pair = CadData("nli", ["p0", "p1", "p2", "p3"], ["h0", "h1", "h2", "x"], [0, 2, 1, 0], [True] * 4,
                         list(range(4)))
    assert "1 have other texts (first: id '3')" in message(B.load_bias, path, data=other_pair)


def test_a_file_without_fingerprint_is_refused_when_data_is_given(tmp_path):
    """Old files (and files saved without data=) carry no fingerprint: their ids cannot be checked, so a caller that
    asks for the check gets an error telling it to write the file again; without data= they load as before."""
    d, lp = nli(), log_probs()
    path = B.save_bias(tmp_path / "b.jsonl", d.ids, lp, d.label_names)
    assert "fingerprint" not in json.loads(open(path).readline())
    assert torch.equal(B.load_bias(path, ids=d.ids), lp)
    msg = message(B.load_bias, path, data=d)
    assert str(path) in msg and "no fingerprint" in msg and "cat-fast bias fit" in msg


def test_bad_arguments_and_broken_fingerprints(tmp_path):
    d, lp = nli(), log_probs()
    assert "data's ids are not ids" in message(B.save_bias, tmp_path / "b.jsonl", ["a", "b", "c", "d"], lp,
                                               d.label_names, data=d)
    path = B.save_bias(tmp_path / "b.jsonl", d.ids, lp, d.label_names, data=d)
    assert "ids= and data= both given" in message(B.load_bias, path, ids=d.ids, data=d)
    assert "expected the examples (a CadData" in message(B.load_bias, path, data=["0", "1"])
    lines = open(path).read().splitlines()
    row = json.loads(lines[2])
    del row["sha256"]
    (tmp_path / "c.jsonl").write_text("\n".join(lines[:2] + [json.dumps(row)] + lines[3:]) + "\n")
    assert "id '1' (line 3): no fingerprint" in message(B.read_bias, tmp_path / "c.jsonl")
    head = json.loads(lines[0])
    head["fingerprint"] = "md5"
    (tmp_path / "c.jsonl").write_text("\n".join([json.dumps(head)] + lines[1:]) + "\n")
    assert "fingerprint 'md5'" in message(B.read_bias, tmp_path / "c.jsonl")
