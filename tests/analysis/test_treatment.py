"""cat_fast.analysis.treatment: each treatment rule on a small table, the control set as the complement."""
import math

import pytest
import torch

from cat_fast.analysis.treatment import class_balanced, select_treatment
from cat_fast.data import load_table

ROWS = [  # text, label, cue
    ("good film", "pos", "yes"), ("great acting", "pos", "no"), ("bad plot", "neg", "yes"),
    ("dull scenes", "neg", "no"), ("lovely music", "pos", "yes"), ("awful ending", "neg", "no"),
]


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "t.tsv"
    path.write_text("text\tlabel\tcue\n" + "".join("\t".join(r) + "\n" for r in ROWS), encoding="utf-8")
    return load_table(str(path))


@pytest.fixture
def pairs(tmp_path):
    path = tmp_path / "p.tsv"
    rows = [("a cat sat on the mat", "a cat sat", "entailment"), ("a dog ran", "the sky is blue", "contradiction"),
            ("men play chess", "men play chess", "entailment"), ("kids swim", "birds fly south", "neutral"),
            ("two women talk", "two women talk loudly", "neutral"), ("a boy reads", "nobody reads", "contradiction")]
    path.write_text("premise\thypothesis\tlabel\n" + "".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")
    return load_table(str(path))


def _split(treat, control, n):
    assert sorted(treat.tolist() + control.tolist()) == list(range(n))
    assert not set(treat.tolist()) & set(control.tolist())


def test_ids(table):
    treat, control = select_treatment(table, ids=["0", "2", 4])
    assert treat.tolist() == [0, 2, 4] and control.tolist() == [1, 3, 5]
    with pytest.raises(ValueError, match="treatment id '9' is not an example id"):
        select_treatment(table, ids=["0", "9"])


def test_where(table):
    cue = [r[2] for r in ROWS]
    treat, control = select_treatment(table, where=(cue, "yes"))
    assert treat.tolist() == [0, 2, 4]
    _split(treat, control, 6)
    with pytest.raises(ValueError, match="has no rows"):
        select_treatment(table, where=(cue, "maybe"))
    with pytest.raises(ValueError, match="one value per row"):
        select_treatment(table, where=(cue[:3], "yes"))


def test_bias_confidence(table):
    p = torch.tensor([[0.9, 0.1], [0.5, 0.5], [0.15, 0.85], [0.7, 0.3], [0.05, 0.95], [0.6, 0.4]])
    treat, control = select_treatment(table, bias=p.log(), confidence=0.8)
    assert treat.tolist() == [0, 2, 4] and control.tolist() == [1, 3, 5]
    treat, _ = select_treatment(table, bias=p.log(), confidence=0.6)
    assert treat.tolist() == [0, 2, 3, 4, 5]
    with pytest.raises(ValueError, match=r"expected \[6, C\]"):
        select_treatment(table, bias=p[:4].log())


def test_overlap_quantile(pairs):
    treat, control = select_treatment(pairs, overlap_quantile=0.5)
    assert treat.tolist() == [0, 2, 4]  # hypotheses found (almost) whole in their premise
    _split(treat, control, 6)
    with pytest.raises(ValueError, match="needs text pairs"):
        select_treatment(load_table_single(pairs), overlap_quantile=0.5)


def load_table_single(pairs):
    from dataclasses import replace

    return replace(pairs, text_pair=None)


def test_one_class_zero_rows_every_row_and_rule_count(table):
    cue = [r[2] for r in ROWS]
    with pytest.raises(ValueError, match="holds class pos only"):
        select_treatment(table, ids=["0", "1"])
    with pytest.raises(ValueError, match="every one of the 6 rows"):
        select_treatment(table, where=(["x"] * 6, "x"))
    with pytest.raises(ValueError, match="exactly one rule"):
        select_treatment(table, ids=["0"], where=(cue, "yes"))
    with pytest.raises(ValueError, match="exactly one rule"):
        select_treatment(table)


def test_class_balanced(table):
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([0, 1, 2, 4])  # pos 0, 1, 4; neg 2
    picked = class_balanced(table.labels, rows, None, g)
    labels = [table.labels[i] for i in picked.tolist()]
    assert len(picked) == 2 and sorted(labels) == [0, 1] and set(picked.tolist()) <= set(rows.tolist())
    picked = class_balanced(table.labels, torch.arange(6), 2, g)
    assert len(picked) == 4 and math.isclose(sum(table.labels[i] for i in picked.tolist()), 2)
