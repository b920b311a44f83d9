"""cat_fast.data.load_hans / score_hans on the shipped HANS-style file, and a small file of our own."""
import collections
import os

import pytest
import torch

from cat_fast import data as D

NLI = ("entailment", "neutral", "contradiction")


@pytest.fixture(scope="module")
def hans():
    return D.load_hans()


def test_shipped_file(hans):
    assert isinstance(hans, D.HansData) and isinstance(hans, D.CadData)
    assert len(hans) == 3000 and hans.task == "hans" and hans.label_names == ("entailment", "non-entailment")
    assert hans.text_pair is not None and hans.spec.text_columns == ("sentence1", "sentence2")
    assert hans.class_counts() == {"entailment": 1500, "non-entailment": 1500}
    assert hans.ids[:2] == ["0", "1"] and len(set(hans.ids)) == 3000
    subcases = collections.Counter(hans.subcase)
    assert len(subcases) == 30 and set(subcases.values()) == {100}
    assert collections.Counter(hans.heuristic) == {h: 1000 for h in D.HANS_HEURISTICS}
    for h, s, y in zip(hans.heuristic, hans.subcase, hans.labels):
        # the subcase's prefix names its heuristic (l/s/c) and its gold label (e/n)
        assert s[0] == h[0] and s[1] == "en"[y], (h, s, y)
    assert hans.text[0] == "The senator introduced the actors ." and hans.text_pair[0] == "The actors introduced the senator ."
    # shipped beside its licence and README
    folder = os.path.dirname(D.HANS_PATH)
    assert sorted(os.listdir(folder)) == ["LICENSE", "README.md", "dev.tsv"]
    assert "MIT License" in open(os.path.join(folder, "LICENSE")).read()


def test_subset_keeps_heuristic_and_subcase(hans):
    s = hans.subset([2999, 0, 1500])
    assert isinstance(s, D.HansData) and s.ids == ["2999", "0", "1500"]
    assert s.heuristic == [hans.heuristic[i] for i in (2999, 0, 1500)]
    assert s.subcase == [hans.subcase[i] for i in (2999, 0, 1500)]


def test_score_known_predictions(hans):
    n = len(hans)
    cells = [f"hans/{h}/{g}" for h in D.HANS_HEURISTICS for g in D.HANS_LABELS]
    # all entailment: right on every entailment cell, wrong on every non-entailment cell
    s = D.score_hans([0] * n, hans, NLI)
    assert s["hans"] == {"accuracy": 0.5, "n": 3000}
    assert s["hans/entailment"] == {"accuracy": 1.0, "n": 1500}
    for c in cells:
        assert s[c] == {"accuracy": 1.0 if c.endswith("/entailment") else 0.0, "n": 500}, c
    for sub in set(hans.subcase):
        assert s[f"hans/subcase/{sub}"] == {"accuracy": 1.0 if sub[1] == "e" else 0.0, "n": 100}
    assert len([k for k in s if k.startswith("hans/subcase/")]) == 30
    assert s["hans/lexical_overlap"] == {"accuracy": 0.5, "n": 1000}
    # neutral and contradiction both count as non-entailment: the mirror image
    for pred in ([1] * n, ["contradiction"] * n, torch.full((n,), 2)):
        t = D.score_hans(pred, hans, NLI)
        for c in cells:
            assert t[c]["accuracy"] == (0.0 if c.endswith("/entailment") else 1.0)
    # the gold labels as predictions of a 2-way model: all right; scores [N, C] are argmax-ed
    gold = torch.tensor(hans.labels)
    assert D.score_hans(gold, hans, D.HANS_LABELS)["hans"]["accuracy"] == 1.0
    scores = torch.nn.functional.one_hot(torch.where(gold == 0, 0, 2), 3).float()
    assert all(v["accuracy"] == 1.0 for v in D.score_hans(scores, hans, NLI).values())
    # one subcase wrong
    pred = ["entailment" if y == 0 else "neutral" for y in hans.labels]
    for i, sub in enumerate(hans.subcase):
        if sub == "ln_passive":
            pred[i] = "entailment"
    t = D.score_hans(pred, hans, NLI)
    assert t["hans/subcase/ln_passive"] == {"accuracy": 0.0, "n": 100}
    assert t["hans/lexical_overlap/non-entailment"] == {"accuracy": 0.8, "n": 500}
    assert t["hans"]["accuracy"] == pytest.approx(2900 / 3000)


def test_score_errors(hans):
    with pytest.raises(ValueError, match="has no 'entailment'"):
        D.score_hans([0] * len(hans), hans, ("positive", "negative"))
    with pytest.raises(ValueError, match="2 predictions for 3000 examples"):
        D.score_hans([0, 1], hans, NLI)
    with pytest.raises(ValueError, match="prediction 0 is 3"):
        D.score_hans([3] * len(hans), hans, NLI)
    with pytest.raises(ValueError, match="prediction 0 is 'yes'"):
        D.score_hans(["yes"] * len(hans), hans, NLI)
    with pytest.raises(ValueError, match=r"expected \[N, 3\]"):
        D.score_hans(torch.zeros(len(hans), 2), hans, NLI)
    with pytest.raises(ValueError, match="expected integer label ids"):
        D.score_hans(torch.zeros(len(hans)), hans, NLI)
    plain = D.CadData("nli", ["a"], ["b"], [0], [True], [0])
    with pytest.raises(ValueError, match="no heuristic / subcase"):
        D.score_hans([0], plain, NLI)


def test_own_file(tmp_path):
    rows = ["sentence1\tsentence2\tgold_label\theuristic\tsubcase",
            "The cat slept .\tThe cat slept .\tentailment\tsubsequence\tse_x",
            "The dog saw the cat .\t \tnon-entailment\tlexical_overlap\tln_y",  # blank hypothesis: skipped
            "The dog saw the cat .\tThe cat saw the dog .\tnon-entailment\tlexical_overlap\tln_y"]
    p = tmp_path / "h.tsv"
    p.write_text("\n".join(rows) + "\n")
    h = D.load_hans(p)
    assert len(h) == 2 and h.skipped == 1 and h.ids == ["0", "2"]
    assert h.heuristic == ["subsequence", "lexical_overlap"] and h.subcase == ["se_x", "ln_y"]
    s = D.score_hans(["entailment", "entailment"], h, NLI)
    assert s["hans"] == {"accuracy": 0.5, "n": 2} and "hans/constituent" not in s
    bad = tmp_path / "bad.tsv"
    bad.write_text("\n".join(rows[:2] + ["The cat .\tThe cat .\tentailment\t\tse_x"]) + "\n")
    with pytest.raises(D.DataError, match=r"bad.tsv: line 3: empty 'heuristic'"):
        D.load_hans(bad)
    wrong = tmp_path / "wrong.tsv"
    wrong.write_text("\n".join(rows[:2] + ["The cat .\tThe cat .\tneutral\tsubsequence\tse_x"]) + "\n")
    with pytest.raises(D.DataError, match="unknown label 'neutral'"):
        D.load_hans(wrong)
    missing = tmp_path / "missing.tsv"
    missing.write_text("sentence1\tsentence2\tgold_label\nA\tB\tentailment\n")
    with pytest.raises(D.DataError, match="missing column"):
        D.load_hans(missing)
