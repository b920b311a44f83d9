"""cat-fast on a user's files without column options (the names of run_glue.py and the datasets hub), splits of a
DatasetDict folder (``PATH@SPLIT``; ``--dev`` takes ``validation``), and the choices it refuses to guess."""
import argparse
import json
import os

import pytest
import torch

from tests.cli.conftest import run, write_csv

datasets = pytest.importorskip("datasets")

WORDS = ("good", "great", "fine", "bad", "awful", "poor", "ok", "plain", "movie", "film", "plot", "actor")


def examples(n, seed=0, text="text", label="label", pair=None):
    """n rows with a text (and a pair text) and a string label, both labels present."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        words = [WORDS[int(j)] for j in torch.randint(len(WORDS), (5,), generator=g)]
        row = {text: " ".join(words), label: ("neg", "pos")[i % 2]}
        if pair:
            row[pair] = " ".join(words[:2])
        out.append(row)
    return out


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def train_args(tiny, train, out, *extra):
    return ["train", "--train", train, "--method", "erm", "--model", tiny, "--epochs", 1, "--batch-size", 8,
            "--max-length", 16, "--out", out, *extra]


def one_line_error(code, err, out=None):
    """The error: one line, the last (a "cat-fast: columns:" line of an earlier file may come before it)."""
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("cat-fast: error: "), err
    assert all(line.startswith("cat-fast: columns: ") for line in lines[:-1]), err
    err = lines[-1]
    if out is not None:
        assert not os.path.exists(out)
    return err


def test_dev_datasetdict_scores_its_validation_split(tiny, tmp_path, capsys):
    """A DatasetDict folder given as --dev is scored on its validation split, not its train split."""
    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(examples(48)),
                          "validation": datasets.Dataset.from_list(examples(16, seed=1))}).save_to_disk(str(folder))
    train = write_jsonl(tmp_path / "train.jsonl", examples(16, seed=2))
    out = tmp_path / "o"
    code, err = run(train_args(tiny, train, out, "--text-column", "text", "--label-column", "label", "--dev", folder,
                               "--no-checkpoint"), capsys)
    assert code == 0, err
    assert json.loads((out / "metrics.json").read_text())["eval"]["dev"]["n"] == 16


def test_splits_chosen_with_path_at_split(tiny, tmp_path, capsys):
    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(examples(24)),
                          "test": datasets.Dataset.from_list(examples(10, seed=1)),
                          "other": datasets.Dataset.from_list(examples(6, seed=3))}).save_to_disk(str(folder))
    out = tmp_path / "o"
    code, err = run(train_args(tiny, folder, out, "--dev", f"{folder}@test", "--eval", f"more={folder}@other",
                               "--no-checkpoint"), capsys)
    assert code == 0, err
    m = json.loads((out / "metrics.json").read_text())
    assert m["data"]["n_train"] == 24 and m["eval"]["dev"]["n"] == 10 and m["eval"]["more"]["n"] == 6
    # no validation split: --dev says which splits there are and how to choose
    err = one_line_error(*run(train_args(tiny, folder, tmp_path / "p", "--dev", folder), capsys), tmp_path / "p")
    assert "3 splits (train, test, other)" in err and "'validation'" in err and f"{folder}@SPLIT" in err
    err = one_line_error(*run(train_args(tiny, f"{folder}@nope", tmp_path / "p"), capsys), tmp_path / "p")
    assert "no split 'nope'" in err and "train, test, other" in err
    err = one_line_error(*run(train_args(tiny, f"{folder}@", tmp_path / "p"), capsys), tmp_path / "p")
    assert "expected a split name after '@'" in err


def test_train_and_eval_find_text_and_label_by_name(tiny, tmp_path, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", examples(16))
    dev = write_csv(tmp_path / "dev.csv", examples(8, seed=1, text="sentence", label="labels"))
    out = tmp_path / "o"
    code, err = run(train_args(tiny, train, out, "--dev", dev), capsys)
    assert code == 0, err
    said = [line for line in err.splitlines() if line.startswith("cat-fast: columns:")]
    assert said[0] == (f"cat-fast: columns: text=text, label=label (found by name in {train}; --text-column / "
                       "--text-pair-column / --label-column to choose)")
    assert said[1].startswith("cat-fast: columns: text=sentence, label=labels (found by name in ") and len(said) == 2
    m = json.loads((out / "metrics.json").read_text())
    assert m["labels"] == ["neg", "pos"] and m["data"]["n_train"] == 16 and m["eval"]["dev"]["n"] == 8
    assert json.loads((out / "cat_fast.json").read_text())["columns"] == {}
    # eval: the checkpoint's files were found by name; so are these
    code, err = run(["eval", "--model", out, "--eval", f"again={dev}", "--out", tmp_path / "e"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "e" / "metrics.json").read_text())["eval"]["again"] == m["eval"]["dev"]


def test_eval_of_a_model_without_a_record_finds_columns_by_name(tiny, tmp_path, capsys):
    ev = write_jsonl(tmp_path / "ev.jsonl", examples(6, text="review"))
    code, err = run(["eval", "--model", tiny, "--eval", f"ev={ev}", "--labels", "neg,pos", "--out", tmp_path / "e"],
                    capsys)
    assert code == 0 and "cat-fast: columns: text=review, label=label (found by name" in err, err
    assert json.loads((tmp_path / "e" / "metrics.json").read_text())["eval"]["ev"]["n"] == 6
    err = one_line_error(*run(["eval", "--model", tiny], capsys))
    assert "--task or --eval NAME=FILE is required" in err


def test_pairs_by_name_and_explicit_options_win(tiny, tmp_path, capsys):
    rows = examples(16, text="premise", pair="hypothesis")
    train = write_csv(tmp_path / "train.csv", rows)
    code, err = run(train_args(tiny, train, tmp_path / "pairs", "--no-checkpoint"), capsys)
    assert code == 0, err
    assert "cat-fast: columns: text=premise, text pair=hypothesis, label=label (found by name" in err
    # a pair and a single text, or two single texts: one line naming the candidates and the options
    mixed = write_csv(tmp_path / "mixed.csv", [dict(r, sentence="another") for r in rows])
    err = one_line_error(*run(train_args(tiny, mixed, tmp_path / "x"), capsys), tmp_path / "x")
    assert "several text columns found by name: premise + hypothesis, sentence" in err
    tsv = tmp_path / "both.tsv"
    tsv.write_text("text\tsentence\tlabel\na b\tc d\tneg\ne f\tg h\tpos\n")
    err = one_line_error(*run(train_args(tiny, tsv, tmp_path / "x"), capsys), tmp_path / "x")
    assert "several text columns found by name: text, sentence" in err and "--text-column NAME" in err
    # an explicit column wins; the label is still found by name
    code, err = run(train_args(tiny, tsv, tmp_path / "y", "--text-column", "sentence", "--no-checkpoint"), capsys)
    assert code == 0, err
    assert "cat-fast: columns: text=sentence, label=label (found by name" in err
    code, err = run(train_args(tiny, tsv, tmp_path / "z", "--text-column", "sentence", "--label-column", "label",
                               "--no-checkpoint"), capsys)
    assert code == 0 and "found by name" not in err, err
    # a pair text without its first text, and a file with neither convention
    err = one_line_error(*run(train_args(tiny, tsv, tmp_path / "x", "--text-pair-column", "text"), capsys))
    assert "--text-pair-column needs --text-column" in err
    none = write_jsonl(tmp_path / "none.jsonl", [{"body": "a b", "y": 1}, {"body": "c", "y": 0}])
    err = one_line_error(*run(train_args(tiny, none, tmp_path / "x"), capsys), tmp_path / "x")
    assert "no text column found by name" in err and "found columns body, y" in err and "--text-column" in err
    # a text pair found in the training file, single texts in the dev file: refused
    dev = write_jsonl(tmp_path / "dev.jsonl", examples(4))
    err = one_line_error(*run(train_args(tiny, train, tmp_path / "x", "--dev", dev), capsys), tmp_path / "x")
    assert "single texts" in err and "text pairs" in err


def test_nothing_to_train_on_says_both_ways(tiny, tmp_path, capsys):
    err = one_line_error(*run(["train", "--method", "erm", "--model", tiny, "--out", tmp_path / "x"], capsys))
    assert "--task sentiment|nli" in err and "--train FILE" in err


def test_bias_fit_finds_pairs_by_name(tmp_path, capsys):
    rows = examples(24, text="sentence1", pair="sentence2")
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    code, err = run(["bias", "fit", "--kind", "overlap", "--train", train, "--out", tmp_path / "b"], capsys)
    assert code == 0, err
    assert "text=sentence1, text pair=sentence2, label=label (found by name" in err
    assert json.loads((tmp_path / "b" / "bias_meta.json").read_text())["n"] == 24


def test_source_rule_is_shared_by_every_command(tmp_path):
    """eval, bias fit, mediation --samples and unlearn read through Source: one rule for all."""
    from cat_fast.cli.common import CliError
    from cat_fast.cli.sources import Source

    args = argparse.Namespace(text_column=None, text_pair_column=None, label_column=None, group_column=None,
                              id_column=None, labels=None, task=None)
    source = Source.from_args(args, {"task": "custom", "columns": {}, "labels": ["neg", "pos"]})
    path = write_jsonl(tmp_path / "s.jsonl", examples(6, text="premise", pair="hypothesis"))
    data = source.read(path)
    assert data.text_pair is not None and data.label_names == ("neg", "pos")
    with pytest.raises(CliError, match="needs --text-column"):
        Source.from_args(argparse.Namespace(**dict(vars(args), text_pair_column="hypothesis")))
