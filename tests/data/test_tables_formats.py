"""load_table without column options (the names of run_glue.py and the datasets hub), in every format: CSV, TSV,
JSON Lines, a JSON array, save_to_disk Dataset and DatasetDict folders, datasets objects, folders of data files;
the split of a DatasetDict; the choices it refuses to guess."""
import csv
import json

import pytest

from cat_fast import data as D

ROWS = [{"premise": "a good film", "hypothesis": "good", "label": "yes"},
        {"premise": "a bad film", "hypothesis": "good", "label": "no"},
        {"premise": "   ", "hypothesis": "x", "label": "no"},
        {"premise": "fine", "hypothesis": "ok", "label": "yes"}]


def error(fn, *args, kind=D.DataError, **kw) -> str:
    with pytest.raises(kind) as e:
        fn(*args, **kw)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def write_delimited(path, rows, delimiter):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter=delimiter)
        w.writeheader()
        w.writerows(rows)
    return str(path)


def check(d, where=None):
    assert d.text == ["a good film", "a bad film", "fine"] and d.text_pair == ["good", "good", "ok"]
    assert d.label_names == ("no", "yes") and d.labels == [1, 0, 1] and d.skipped == 1
    assert d.spec.text_columns == ("premise", "hypothesis") and d.spec.label_column == "label"
    if where is not None:
        assert d.sources[0] == where


def test_every_file_format_by_name(tmp_path):
    csv_path = write_delimited(tmp_path / "t.csv", ROWS, ",")
    check(D.load_table(csv_path), f"{csv_path}:2")
    tsv_path = write_delimited(tmp_path / "t.tsv", ROWS, "\t")
    check(D.load_table(tsv_path), f"{tsv_path}:2")
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    check(D.load_table(str(jsonl)), f"{jsonl}:1")
    lines_json = tmp_path / "lines.json"  # JSON Lines in a .json file
    lines_json.write_text(jsonl.read_text())
    check(D.load_table(str(lines_json)))
    array = tmp_path / "t.json"
    array.write_text("\ufeff " + json.dumps(ROWS, indent=2))
    d = D.load_table(array)  # a pathlib.Path, a BOM and a JSON array of objects
    check(d, f"{array}:0")
    assert d.sources[-1] == f"{array}:3"


def test_json_array_problems(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('[{"text": "a", "label": 1}, 7]')
    assert error(D.load_table, str(p)).startswith(f"{p}: item 1: a JSON int, expected an object (a JSON array of")
    p.write_text('[{"text": "a", "label": 1},\n {"text": "b", "label": }]')
    assert error(D.load_table, str(p)).startswith(f"{p}: line 2: not valid JSON: Expecting value")
    p.write_text("[]")
    assert error(D.load_table, str(p)).startswith(f"{p}: an empty array; expected a JSON array of objects")
    p.write_text('[{"text": "a", "label": 1}, {"text": "b"}]')
    assert error(D.load_table, str(p)).startswith(f"{p}: item 1: missing column(s) label")
    q = tmp_path / "a.jsonl"  # a .jsonl file stays JSON Lines
    q.write_text('[{"text": "a", "label": 1},\n{"text": "b", "label": 0}]\n')
    assert "the file starts a JSON array" in error(D.load_table, str(q))


def test_find_columns_rules():
    assert D.find_columns(["idx", "sentence", "label"]) == ("sentence", None, "label")
    assert D.find_columns(["question", "sentence", "label", "idx"]) == ("question", "sentence", "label")  # QNLI
    assert D.find_columns(["sentence1", "sentence2", "labels"]) == ("sentence1", "sentence2", "labels")
    assert D.find_columns(["review", "stars"], label_column="stars") == ("review", None, "stars")
    assert D.find_columns(["text", "sentence", "label"], text_column="sentence") == ("sentence", None, "label")
    assert D.find_columns(["text", "label"], "text", "label", "label") == ("text", "label", "label")  # all given
    msg = error(D.find_columns, ["text", "review", "label"], name="f.csv", kind=D.ChoiceError)
    assert msg == "f.csv: several text columns found by name: text, review; choose with text_column= / text_pair_column="
    msg = error(D.find_columns, ["premise", "hypothesis", "sentence1", "sentence2", "label"], kind=D.ChoiceError)
    assert "several text columns found by name: sentence1 + sentence2, premise + hypothesis" in msg
    msg = error(D.find_columns, ["body", "y"], name="f.csv", kind=D.ChoiceError)
    assert msg.startswith("f.csv: no text column found by name (looked for text, sentence, review and the pairs "
                          "sentence1 + sentence2, premise + hypothesis, question + sentence); found columns body, y")
    e = pytest.raises(D.ChoiceError, D.find_columns, ["text", "label", "labels"]).value
    assert "several label columns found by name: label, labels" in str(e) and e.keywords == ("label_column",)
    assert e.advise({"label_column": "--label-column NAME"}).endswith("; choose with --label-column NAME")
    assert "no label column found by name (looked for label, labels)" in error(D.find_columns, ["text", "y"])
    assert "needs text_column=" in error(D.find_columns, ["a", "b"], text_pair_column="b")
    assert "needs text_column=" in error(D.load_table, "nowhere.csv", text_pair_column="b")


def test_given_columns_win_and_missing_ones_are_named(tmp_path):
    rows = [{"text": "first", "sentence": "second", "label": 1, "other": "x"},
            {"text": "third", "sentence": "fourth", "label": 0, "other": "y"}]
    p = write_delimited(tmp_path / "w.csv", rows, ",")
    assert "several text columns" in error(D.load_table, p, kind=D.ChoiceError)
    d = D.load_table(p, text_column="sentence")
    assert d.text == ["second", "fourth"] and d.spec.label_column == "label"
    d = D.load_table(p, text_column="text", label_column="other")
    assert d.label_names == ("x", "y")
    assert "no label column found by name" in error(D.load_table, p, text_column="label")  # label: the text
    assert "expected different columns" in error(D.load_table, p, text_column="text", text_pair_column="text")


def test_datasets_folders_objects_and_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(ROWS)
    check(D.load_table(ds), "Dataset:0")
    ds.save_to_disk(str(tmp_path / "ds"))
    check(D.load_table(tmp_path / "ds"))
    assert "has no splits" in error(D.load_table, ds, split="train")
    dd = datasets.DatasetDict({"train": ds, "validation": ds.select([0, 1]), "test": ds.select([3])})
    dd.save_to_disk(str(tmp_path / "dd"))
    for source, name in ((dd, "DatasetDict"), (str(tmp_path / "dd"), str(tmp_path / "dd"))):
        check(D.load_table(source), f"{name}[train]:0")  # several splits: train
        assert len(D.load_table(source, default_split="validation")) == 2
        assert D.load_table(source, split="test").text == ["fine"]
        msg = error(D.load_table, source, split="dev", kind=D.ChoiceError)
        assert msg == f"{name}: no split 'dev'; splits found: train, validation, test; choose with split="
    only = datasets.DatasetDict({"test": ds.select([3])})
    assert D.load_table(only, default_split="validation").text == ["fine"]  # one split: that one
    two = datasets.DatasetDict({"a": ds, "b": ds})
    msg = error(D.load_table, two, default_split="validation", kind=D.ChoiceError)
    assert msg == "DatasetDict: 2 splits (a, b) and none is 'validation'; choose with split="
    assert "expected a .csv" in error(D.load_table, ["not", "a", "dataset"])


def test_folders_of_data_files_through_load_dataset(tmp_path):
    pytest.importorskip("datasets")
    csvs = tmp_path / "csvs"
    csvs.mkdir()
    write_delimited(csvs / "train.csv", ROWS, ",")
    write_delimited(csvs / "validation.csv", ROWS[:2], ",")
    check(D.load_table(str(csvs)))
    assert len(D.load_table(str(csvs), default_split="validation")) == 2
    jsons = tmp_path / "jsons"
    jsons.mkdir()
    (jsons / "train.json").write_text(json.dumps(ROWS))  # a JSON array
    (jsons / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:1]))
    check(D.load_table(str(jsons)))
    assert D.load_table(str(jsons), split="test").text == ["a good film"]
