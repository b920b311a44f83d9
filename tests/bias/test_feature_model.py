"""FeatureBias and its columns: the exact conditional against hand counts, the logistic model (built-in solver and
scikit-learn's agree), the columns read from the file and aligned to the examples, and the refusals."""
import csv
import math

import pytest
import torch

from cat_fast import bias, data

ROWS = [  # genre, cue, label
    ("news", "x", "pos"), ("news", "x", "pos"), ("news", "x", "neg"), ("news", "y", "neg"),
    ("blog", "x", "pos"), ("blog", "y", "neg"), ("blog", "y", "neg"), ("blog", "y", "neg"),
    ("news", "y", "pos"), ("blog", "x", "neg"),
]


def write_csv(path, header, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return str(path)


@pytest.fixture
def table(tmp_path):
    rows = [(f"text {i}", y, g, c, str(0.5 * i)) for i, (g, c, y) in enumerate(ROWS)]
    return data.load_table(write_csv(tmp_path / "t.csv", ["text", "label", "genre", "cue", "length"], rows))


def columns(d, names, categorical=()):
    return bias.typed_columns(d, bias.read_feature_columns(d, names), categorical)


def test_exact_conditional_equals_hand_counts(table):
    cols = columns(table, ["genre", "cue"])
    assert [c.kind for c in cols] == ["categorical", "categorical"]
    alpha = 0.5
    fb = bias.FeatureBias("exact", smoothing=alpha).fit(cols, table.labels, 2)
    got = fb.log_probs(cols).exp()
    names = table.label_names  # ("neg", "pos")
    for i, (g, c, _) in enumerate(ROWS):
        n = {y: sum(1 for r in ROWS if r[:2] == (g, c) and r[2] == y) for y in names}
        want = [(n[y] + alpha) / (sum(n.values()) + 2 * alpha) for y in names]
        torch.testing.assert_close(got[i], torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    # fitted on rows 0-3 (news only): a blog row gets the smoothed prior of those rows (2 pos, 2 neg... by hand)
    fb = bias.FeatureBias("exact", smoothing=alpha).fit(cols, table.labels, 2, rows=[0, 1, 2, 3])
    prior = [(2 + alpha) / (4 + 2 * alpha), (2 + alpha) / (4 + 2 * alpha)]
    torch.testing.assert_close(fb.log_probs(cols, [4]).exp()[0], torch.tensor(prior, dtype=torch.float64))
    assert fb.meta()["model_type"] == "exact" and fb.meta()["combinations"] == 2


def test_auto_is_exact_for_categories_and_logistic_with_numbers(table):
    cat = columns(table, ["genre"])
    num = columns(table, ["genre", "length"])
    assert [c.kind for c in num] == ["categorical", "numeric"]
    assert bias.FeatureBias().fit(cat, table.labels, 2).model_type_ == "exact"
    assert bias.FeatureBias(solver="builtin").fit(num, table.labels, 2).model_type_ == "logistic"
    with pytest.raises(ValueError, match="model_type='exact' needs categorical columns; length numeric"):
        bias.FeatureBias("exact").fit(num, table.labels, 2)
    forced = columns(table, ["length"], categorical=["length"])
    assert forced[0].kind == "categorical"


@pytest.mark.parametrize("classes", [2, 3])
@pytest.mark.parametrize("class_weight", [None, "balanced"])
def test_builtin_and_sklearn_logistic_agree(classes, class_weight):
    pytest.importorskip("sklearn", reason="scikit-learn is an optional extra (cat_fast[bias])")
    g = torch.Generator().manual_seed(0)
    n = 90
    genre = [["a", "b", "c"][int(k)] for k in torch.randint(0, 3, (n,), generator=g)]
    length = torch.randn(n, generator=g, dtype=torch.float64).tolist()
    labels = [(i + (genre[i] == "a")) % classes for i in range(n)]
    cols = [bias.FeatureColumn("genre", "categorical", genre), bias.FeatureColumn("length", "numeric", length)]
    kw = dict(C=0.5, class_weight=class_weight)
    ours = bias.FeatureBias("logistic", solver="builtin", **kw).fit(cols, labels, classes, rows=range(60))
    sk = bias.FeatureBias("logistic", solver="sklearn", **kw).fit(cols, labels, classes, rows=range(60))
    assert (ours.solver_, sk.solver_) == ("builtin", "sklearn")
    torch.testing.assert_close(sk.log_probs(cols).exp(), ours.log_probs(cols).exp(), rtol=0, atol=1e-5)


def test_columns_follow_the_examples_past_skipped_rows(tmp_path):
    path = write_csv(tmp_path / "s.csv", ["text", "label", "genre"],
                     [("a", "p", "g1"), ("  ", "n", "skipped"), ("b", "n", "g2"), ("c", "p", "g1")])
    d = data.load_table(path)
    assert d.skipped == 1
    assert bias.read_feature_columns(d, ["genre"]) == {"genre": ["g1", "g2", "g1"]}


def test_columns_of_a_dataset_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"text": ["a", "b", "c"], "label": [0, 1, 0], "genre": ["g1", "g2", "g3"]}
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                               "validation": datasets.Dataset.from_dict(rows)})
    dd.save_to_disk(str(tmp_path / "ds"))
    d = data.load_table(str(tmp_path / "ds"))
    assert d.sources[0].endswith("ds[train]:0")
    assert bias.read_feature_columns(d, ["genre"]) == {"genre": ["g1", "g2", "g3"]}


def test_jsonl_numbers_and_categories(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_text('{"text": "a", "label": 0, "n": 1, "flag": true}\n{"text": "b", "label": 1, "n": 2.5, '
                    '"flag": false}\n', encoding="utf-8")
    d = data.load_table(str(path))
    cols = columns(d, ["n", "flag"])
    assert [(c.kind, c.values) for c in cols] == [("numeric", [1.0, 2.5]), ("categorical", ["true", "false"])]


@pytest.mark.parametrize("values, words", [
    (["x", "", "y"], "feature column 'f' has 1 missing value(s) (first: "),
    (["x", "x", "x"], "feature column 'f' is constant ('x' in all 3 rows)"),
])
def test_missing_and_constant_columns_are_refused(tmp_path, values, words):
    d = data.load_table(write_csv(tmp_path / "m.csv", ["text", "label", "f"],
                                  [(f"t{i}", "ab"[i % 2], v) for i, v in enumerate(values)]))
    with pytest.raises(bias.FeatureColumnError) as e:
        columns(d, ["f"])
    assert words in str(e.value)


def test_a_column_not_in_the_file_is_named(table):
    with pytest.raises(bias.FeatureColumnError, match=r"feature column\(s\) 'nope' not in .*t.csv \(its columns: "
                                                      r"text, label, genre, cue, length\)"):
        bias.read_feature_columns(table, ["genre", "nope"])


def test_non_finite_numbers_are_refused(tmp_path):
    path = tmp_path / "inf.jsonl"
    path.write_text('{"text": "a", "label": 0, "n": 1}\n{"text": "b", "label": 1, "n": Infinity}\n',
                    encoding="utf-8")
    d = data.load_table(str(path))
    with pytest.raises(bias.FeatureColumnError, match="is not finite"):
        columns(d, ["n"])
    assert math.isinf(bias.read_feature_columns(d, ["n"])["n"][1])


def test_without_sklearn_the_builtin_solver_fits(table, monkeypatch):
    from cat_fast.bias import feature_model

    monkeypatch.setattr(feature_model, "has_sklearn", lambda: False)
    cols = columns(table, ["genre", "length"])
    assert bias.FeatureBias("logistic").fit(cols, table.labels, 2).solver_ == "builtin"
    with pytest.raises(ValueError, match="scikit-learn is not installed"):
        bias.FeatureBias("logistic", solver="sklearn")


def test_smoothing_must_be_positive():
    with pytest.raises(ValueError, match="smoothing=0"):
        bias.FeatureBias(smoothing=0)
