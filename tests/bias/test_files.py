"""cat_fast.bias.save_bias / load_bias: round trips through real files, alignment to ids and labels, every error."""
import json
import math
import os

import pytest
import torch

from cat_fast import bias as B

LABELS = ("entailment", "neutral", "contradiction")


def predictions(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [f"ex{i}" for i in range(n)], torch.log_softmax(torch.randn(n, 3, generator=g), 1)


def write_raw(path, rows, labels=LABELS, header=None):
    head = header or {"format": "cat_fast-bias", "version": 1, "label_names": list(labels), "n": len(rows),
                      "meta": {}}
    lines = [json.dumps(head)] + [json.dumps({"id": i, "log_probs": r}) for i, r in rows]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def message(fn, *a, **k):
    with pytest.raises(ValueError) as e:
        fn(*a, **k)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_round_trip(tmp_path):
    ids, lp = predictions()
    path = tmp_path / "train.jsonl"
    assert B.save_bias(path, ids, lp, LABELS, meta={"bias": "overlap", "C": 100.0}) == str(path)
    assert os.listdir(tmp_path) == ["train.jsonl"]  # the temporary file was renamed
    header = json.loads(path.read_text().splitlines()[0])
    assert header["format"] == "cat_fast-bias" and header["label_names"] == list(LABELS) and header["n"] == 6
    got = B.load_bias(path)
    assert got.dtype == torch.float32 and torch.equal(got, lp)  # float32 values survive the decimal text exactly
    assert torch.equal(B.load_bias(path, ids=ids, label_names=LABELS, dtype=torch.float64), lp.double())
    bp = B.read_bias(path)
    assert bp.ids == ids and bp.label_names == LABELS and bp.meta == {"bias": "overlap", "C": 100.0}
    # rows follow the ids asked for, columns the label order asked for
    order = [3, 0, 5, 1, 4, 2]
    got = B.load_bias(path, ids=[ids[i] for i in order], label_names=("contradiction", "entailment", "neutral"))
    assert torch.equal(got, lp[order][:, [2, 0, 1]])
    # extra rows may be ignored on request (a subset of the split)
    assert torch.equal(B.load_bias(path, ids=["ex4", "ex1"], extra="ignore"), lp[[4, 1]])
    # overwriting replaces the file
    B.save_bias(path, ids[:2], lp[:2], LABELS)
    assert B.read_bias(path).ids == ids[:2]


def test_with_cad_ids(tmp_path):
    from cat_fast.data import CadData

    d = CadData("nli", ["p1", "p2"], ["h1", "h2"], [0, 2], [True, True], [0, 1])
    lp = torch.log_softmax(torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 5.0]]), 1)
    B.save_bias(tmp_path / "b.jsonl", d.ids, lp, d.label_names)
    assert torch.equal(B.load_bias(tmp_path / "b.jsonl", ids=d, label_names=d.label_names), lp)


def test_load_errors_name_file_and_id(tmp_path):
    ids, lp = predictions()
    path = str(tmp_path / "b.jsonl")
    B.save_bias(path, ids, lp, LABELS)
    msg = message(B.load_bias, path, ids=ids + ["ex9", "ex10"])
    assert path in msg and "'ex9'" in msg and "2 of 8 id(s) missing" in msg
    msg = message(B.load_bias, path, ids=["ex0", "ex2"])
    assert path in msg and "'ex1'" in msg and "4 extra row(s)" in msg
    msg = message(B.load_bias, path, ids=["ex0", "ex0"], extra="ignore")
    assert "'ex0' requested twice" in msg
    msg = message(B.load_bias, path, label_names=("entailment", "non-entailment"))
    assert path in msg and "expected entailment, non-entailment" in msg
    msg = message(B.load_bias, path, label_names=("entailment", "neutral", "contradiction", "other"))
    assert "labels entailment, neutral, contradiction" in msg
    rows = [(i, r) for i, r in zip(ids, lp.tolist())]
    for bad, what in ((float("nan"), "not all finite"), (float("-inf"), "not all finite"),
                      (0.0, "not normalised")):
        r = list(rows)
        r[2] = (ids[2], [bad, -1.0, -1.0])
        msg = message(B.load_bias, write_raw(tmp_path / "x.jsonl", r))
        assert str(tmp_path / "x.jsonl") in msg and "'ex2'" in msg and what in msg
    lse_off = [(i, [v + 1e-3 for v in row]) for i, row in rows]
    assert "'ex0'" in message(B.load_bias, write_raw(tmp_path / "x.jsonl", lse_off))
    assert B.load_bias(write_raw(tmp_path / "x.jsonl", lse_off), tol=1e-2).shape == (6, 3)
    msg = message(B.load_bias, write_raw(tmp_path / "x.jsonl", rows + [rows[1]]))
    assert "'ex1' repeated (lines 3 and 8)" in msg
    msg = message(B.load_bias, write_raw(tmp_path / "x.jsonl", [(ids[0], [-0.5, -0.9])] + rows[1:]))
    assert "'ex0'" in msg and "expected 3 numbers" in msg
    msg = message(B.load_bias, write_raw(tmp_path / "x.jsonl", rows[:3], header={
        "format": "cat_fast-bias", "version": 1, "label_names": list(LABELS), "n": 6}))
    assert "3 rows but the header says n=6" in msg
    (tmp_path / "y.jsonl").write_text('{"id": "ex0", "log_probs": [0.0]}\n')
    assert "not a cat_fast bias file header" in message(B.load_bias, tmp_path / "y.jsonl")
    (tmp_path / "y.jsonl").write_text("")
    assert "empty file" in message(B.load_bias, tmp_path / "y.jsonl")
    (tmp_path / "y.jsonl").write_text("{not json\n")
    assert "line 1: not valid JSON" in message(B.load_bias, tmp_path / "y.jsonl")
    assert "not found" in message(B.load_bias, tmp_path / "missing.jsonl")
    assert "extra='x'" in message(B.load_bias, path, extra="x")


def test_save_errors_keep_the_old_file(tmp_path):
    ids, lp = predictions()
    path = tmp_path / "b.jsonl"
    B.save_bias(path, ids, lp, LABELS)
    before = path.read_text()
    assert "expected [6, 3]" in message(B.save_bias, path, ids, lp[:, :2], LABELS)
    assert "expected [5, 3]" in message(B.save_bias, path, ids[:5], lp, LABELS)
    assert "id 'ex0' repeated" in message(B.save_bias, path, ["ex0"] + ids[1:5] + ["ex0"], lp, LABELS)
    bad = lp.clone()
    bad[3, 1] = math.inf
    assert "id 'ex3'" in message(B.save_bias, path, ids, bad, LABELS)
    assert "id 'ex0'" in message(B.save_bias, path, ids, lp + 0.1, LABELS)
    assert "'neutral' repeated" in message(B.save_bias, path, ids, lp, ("entailment", "neutral", "neutral"))
    assert "meta cannot be written as JSON" in message(B.save_bias, path, ids, lp, LABELS, meta={"x": object()})
    assert path.read_text() == before and os.listdir(tmp_path) == ["b.jsonl"]


def test_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    ids, lp = predictions()
    path = tmp_path / "b.jsonl"
    B.save_bias(path, ids, lp, LABELS)
    before = path.read_text()

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(B.files.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        B.save_bias(path, ids[:3], lp[:3], LABELS)
    assert path.read_text() == before and os.listdir(tmp_path) == ["b.jsonl"]
