"""`cat-fast bias fit --kind features | weak-learner` and `--folds`: the file written (hand counts, the meta record),
a weak learner on the tiny BERT end to end into `train --method poe --bias`, and every bad input refused with one
line, exit 2 and nothing written."""
import json

import pytest
import torch

from cat_fast.bias import load_bias
from cat_fast.data import load_table

from .conftest import run, write_csv


def planted(n=24):
    """Single texts with a planted cue column (P(cue = 'x' | pos) high), a length column and pair groups of 2."""
    words = ("good", "great", "fine", "bad", "awful", "poor", "ok", "plain", "movie", "film")
    out = []
    for i in range(n):
        label = ("pos", "neg")[i % 2]
        cue = "x" if (label == "pos") != (i % 6 == 0) else "y"
        out.append({"text": " ".join(words[(i + k) % len(words)] for k in range(4)), "label": label, "cue": cue,
                    "genre": ("news", "blog", "wiki")[i % 3], "length": str(3 + i % 5), "pair": str(i // 2),
                    "blank": "" if i == 3 else "v", "same": "k"})
    return out


OWN = ["--text-column", "text", "--label-column", "label"]


def fit_argv(data, out, *extra):
    return ["bias", "fit", "--train", data, *OWN, "--out", out, *extra]


def one_line_error(code, err, *words):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("cat-fast: error: "), (code, err)
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_features_exact_writes_the_smoothed_conditional(tmp_path, capsys):
    rows = planted()
    data = write_csv(tmp_path / "t.csv", rows)
    out = tmp_path / "b"
    code, err = run(fit_argv(data, out, "--kind", "features", "--feature-columns", "cue,genre", "--smoothing", 0.5),
                    capsys)
    assert code == 0, err
    train = load_table(data, text_column="text", label_column="label")
    b = load_bias(out / "bias.jsonl", data=train, label_names=train.label_names).double().exp()
    for i, r in enumerate(rows):
        same = [s["label"] for s in rows if (s["cue"], s["genre"]) == (r["cue"], r["genre"])]
        want = [(same.count(y) + 0.5) / (len(same) + 1.0) for y in train.label_names]
        torch.testing.assert_close(b[i], torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-6)
    meta = json.loads((out / "bias_meta.json").read_text())
    assert meta["kind"] == "features" and meta["folds"] == 1 and meta["in_sample"] and meta["fold_accuracy"] == []
    assert meta["options"]["model_type"] == "exact" and meta["options"]["smoothing"] == 0.5
    assert json.loads((out / "bias.jsonl").open().readline())["meta"] == meta


def test_features_cross_fitted_by_group_with_numbers(tmp_path, capsys):
    data = write_csv(tmp_path / "t.csv", planted())
    out = tmp_path / "b"
    code, err = run(fit_argv(data, out, "--kind", "features", "--feature-columns", "cue,length", "--folds", 4,
                             "--group-column", "pair"), capsys)
    assert code == 0, err
    assert "held out, 4 folds" in err
    meta = json.loads((out / "bias_meta.json").read_text())
    assert meta["options"]["model_type"] == "logistic" and meta["options"]["kinds"] == {"cue": "categorical",
                                                                                       "length": "numeric"}
    assert meta["folds"] == 4 and meta["fold_sizes"] == [6, 6, 6, 6] and len(meta["fold_accuracy"]) == 4
    assert not meta["in_sample"] and all(0 <= a <= 1 for a in meta["fold_accuracy"])


def test_weak_learner_end_to_end_into_poe(tiny, tmp_path, capsys):
    data = write_csv(tmp_path / "t.csv", planted(16))
    bias_dir = tmp_path / "weak"
    code, err = run(fit_argv(data, bias_dir, "--kind", "weak-learner", "--model", tiny, "--subset", 6, "--epochs", 1,
                             "--layers", 1, "--max-length", 16, "--batch-size", 4, "--folds", 2, "--device", "cpu"),
                    capsys)
    assert code == 0, err
    meta = json.loads((bias_dir / "bias_meta.json").read_text())
    assert meta["kind"] == "weak-learner" and meta["folds"] == 2 and len(meta["fold_accuracy"]) == 2
    assert meta["options"]["subset"] == 6 and meta["model"]["layers"] == 1 and meta["model"]["encoder_layers"] == 2
    assert meta["model"]["subset_rows"] == 6
    assert meta["calibration"]["method"] == "temperature"  # the default for a cross-fitted weak learner
    out = tmp_path / "poe"
    code, err = run(["train", "--method", "poe", "--model", tiny, "--train", data, *OWN, "--epochs", 1,
                     "--max-length", 16, "--batch-size", 4, "--bias", bias_dir, "--no-checkpoint", "--out", out],
                    capsys)
    assert code == 0, err
    assert "poe_loss" in json.loads((out / "metrics.json").read_text())["history"][0]["info"]


BAD = [
    (["--kind", "features", "--feature-columns", "cue,nope"], ["--feature-columns cue,nope",
                                                              "feature column(s) 'nope' not in"]),
    (["--kind", "features", "--feature-columns", "blank"], ["feature column 'blank' has 1 missing value(s)"]),
    (["--kind", "features", "--feature-columns", "cue,same"], ["feature column 'same' is constant ('k' in all 24"]),
    (["--kind", "features"], ["--kind features needs --feature-columns"]),
    (["--kind", "features", "--feature-columns", "length", "--model-type", "exact"],
     ["--model-type exact: feature column(s) length hold numbers"]),
    (["--kind", "features", "--feature-columns", "cue", "--folds", 25], ["--folds 25: the training data has 24 rows"]),
    (["--kind", "features", "--feature-columns", "cue", "--folds", 13, "--group-column", "pair"],
     ["--folds 13: the training data has 12 counterfactual groups"]),
    (["--kind", "features", "--feature-columns", "cue", "--folds", 0], ["argument --folds", "'0'"]),
    (["--kind", "overlap", "--feature-columns", "cue"], ["--feature-columns is for --kind features, not overlap"]),
    (["--kind", "features", "--feature-columns", "cue", "--subset", 10], ["--subset is for --kind weak-learner"]),
    (["--kind", "weak-learner", "--subset", 1], ["argument --subset", "expected an integer >= 2"]),
    (["--kind", "column", "--model", "x", "--folds", 2], ["--folds 2: --kind column scores a classifier"]),
    (["--kind", "features", "--feature-columns", "cue", "--calibrate", "temperature"],
     ["--calibrate temperature needs held-out predictions (--folds K > 1)"]),
]


@pytest.mark.parametrize("extra, words", BAD, ids=[" ".join(map(str, b[0]))[:60] for b in BAD])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, extra, words):
    data = write_csv(tmp_path / "t.csv", planted())
    out = tmp_path / "b"
    code, err = run(fit_argv(data, out, *extra), capsys)
    one_line_error(code, err, *words)
    assert not out.exists()


def test_a_subset_of_one_class_is_refused(tiny, tmp_path, capsys):
    rows = planted(30)
    for i, r in enumerate(rows):
        r["label"] = "pos" if i else "neg"  # one 'neg' row: a draw of 2 from 30 misses it
    data = write_csv(tmp_path / "t.csv", rows)
    out = tmp_path / "b"
    code, err = run(fit_argv(data, out, "--kind", "weak-learner", "--model", tiny, "--subset", 2, "--device", "cpu"),
                    capsys)
    one_line_error(code, err, "--subset 2: the 2 example(s) drawn all have the label 'pos'; expected at least two "
                              "classes")
    assert not out.exists()


def test_calibrated_features_keep_their_argmax_and_record_the_temperature(tmp_path, capsys):
    """--calibrate temperature over cross-fitted predictions: the written log-probabilities are
    log_softmax(beta * held-out log-probabilities) with the recorded temperature, the predicted classes unchanged."""
    data = write_csv(tmp_path / "t.csv", planted())
    plain, calibrated = tmp_path / "plain", tmp_path / "cal"
    base = ["--kind", "features", "--feature-columns", "cue", "--folds", 3, "--smoothing", 0.01]
    assert run(fit_argv(data, plain, *base), capsys)[0] == 0
    code, err = run(fit_argv(data, calibrated, *base, "--calibrate", "temperature"), capsys)
    assert code == 0 and "calibrated the held-out predictions" in err, err
    train = load_table(data, text_column="text", label_column="label")
    a = load_bias(plain / "bias.jsonl", data=train, label_names=train.label_names).double()
    b = load_bias(calibrated / "bias.jsonl", data=train, label_names=train.label_names).double()
    cal = json.loads((calibrated / "bias_meta.json").read_text())["calibration"]
    assert json.loads((plain / "bias_meta.json").read_text())["calibration"] is None
    torch.testing.assert_close(b, torch.log_softmax(a / cal["temperature"], -1), rtol=0, atol=1e-6)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert cal["temperature"] > 1 and cal["nll_after"] < cal["nll_before"]  # smoothing 0.01 is over-confident


def test_a_bias_certain_on_most_rows_is_said_before_training(tiny, tmp_path, capsys):
    """A bias file with p(label) = 1 on every training row: the run says it leaves the main model little to learn."""
    from cat_fast.bias import save_bias

    data = write_csv(tmp_path / "t.csv", planted())
    train = load_table(data, text_column="text", label_column="label")
    certain = torch.full((len(train), 2), -30.0, dtype=torch.float64)
    certain[torch.arange(len(train)), torch.tensor(train.labels)] = 0.0
    save_bias(str(tmp_path / "certain.jsonl"), train.ids, certain, train.label_names, {"kind": "hand"}, data=train)
    code, err = run(["train", "--train", data, *OWN, "--method", "poe", "--bias", str(tmp_path / "certain.jsonl"),
                     "--model", tiny, "--epochs", 1, "--batch-size", 8, "--max-length", 16, "--no-checkpoint",
                     "--out", str(tmp_path / "run")], capsys)
    assert code == 0, err
    assert "gives the true label p >= 0.99 on 100% of the training rows" in err


def test_a_collapsed_model_is_said(tiny, tmp_path, capsys):
    """A classifier whose head puts every row into one class: the scored set remembers it (the training command
    prints a warning from it); predictions spread over the classes are not a collapse."""
    import transformers

    from cat_fast.cli.scoring import EvalSet

    data = write_csv(tmp_path / "t.csv", planted())
    table = load_table(data, text_column="text", label_column="label")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tiny)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    scored = EvalSet("dev", table, tokenizer, 16)
    half = [i % 2 for i in range(len(table))]
    scored._check_collapse(half, table.label_names)
    assert scored.collapsed is None
    scored._check_collapse([1] * (len(table) - 1) + [0], table.label_names)  # 23 of 24 rows: under 99 %
    assert scored.collapsed is None
    with torch.no_grad():
        model.classifier.bias.copy_(torch.tensor([50.0, -50.0]))
    scored.evaluate(model, 8, torch.device("cpu"), False)
    assert scored.collapsed == table.label_names[0]
    with torch.no_grad():
        model.classifier.bias.zero_()
        model.classifier.weight.zero_()
    scored.evaluate(model, 8, torch.device("cpu"), False)  # ties: argmax 0 everywhere, still one class
    assert scored.collapsed == table.label_names[0]
