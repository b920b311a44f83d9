"""Arguments and data that cat-fast must refuse with one line (`cat-fast: error: ...`, exit 2) and nothing written:
one-class training data, a bias file for other rows, out-of-range seeds, --C, weight decays and --report-to names."""
import json

import pytest

from cat_fast import cli
from cat_fast.cli.train import check_options

from .conftest import run, write_csv


def pairs(n=12, labels=("yes", "no")):
    """Text pairs whose hypothesis repeats words of the premise for the first label (an overlap bias to fit)."""
    words = ("good", "great", "fine", "bad", "awful", "poor", "ok", "plain", "movie", "film")
    out = []
    for i in range(n):
        premise = " ".join(words[(i + k) % len(words)] for k in range(5))
        label = labels[i % len(labels)]
        hypothesis = " ".join(premise.split()[:2]) if label == labels[0] else words[(i + 7) % len(words)]
        out.append({"premise": premise, "hypothesis": hypothesis, "label": label})
    return out


OWN = ["--text-column", "premise", "--text-pair-column", "hypothesis", "--label-column", "label"]


def one_line_error(code, err, *words):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("cat-fast: error: "), (code, err)
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def train_argv(tiny, data, out, method="erm", *extra):
    return ["train", "--method", method, "--model", tiny, "--train", data, *OWN, "--epochs", 1, "--max-length", 16,
            "--batch-size", 4, "--cat-layers", 1, "--out", out, *extra]


@pytest.mark.parametrize("method", ["erm", "cat", "poe"])
def test_one_class_training_data_is_refused(tiny, tmp_path, capsys, method):
    data = write_csv(tmp_path / "one.csv", pairs(labels=("Positive",)))
    out = tmp_path / "out"
    code, err = run(train_argv(tiny, data, out, method), capsys)
    one_line_error(code, err, "the training data has one class ('Positive'); a classifier needs at least two")
    assert not out.exists()
    code, err = run(train_argv(tiny, data, out, method, "--labels", "Positive,Negative"), capsys)
    one_line_error(code, err, "the training data has one class ('Positive' of 'Positive', 'Negative')")
    code, err = run(["bias", "fit", "--kind", "overlap", "--train", data, *OWN, "--out", out], capsys)
    one_line_error(code, err, "the training data has one class ('Positive')")
    assert not out.exists()


def test_a_bias_file_for_other_rows_is_refused(tiny, tmp_path, capsys):
    rows = pairs()
    data = write_csv(tmp_path / "train.csv", rows)
    bias = tmp_path / "bias"
    code, err = run(["bias", "fit", "--kind", "overlap", "--train", data, *OWN, "--out", bias], capsys)
    assert code == 0, err
    assert json.loads(open(bias / "bias.jsonl").readline())["fingerprint"]
    shuffled = write_csv(tmp_path / "shuffled.csv", rows[1:] + rows[:1])  # ids are row numbers: all shift
    out = tmp_path / "poe"
    code, err = run(train_argv(tiny, shuffled, out, "poe", "--bias", bias), capsys)
    one_line_error(code, err, f"--bias {bias}", "rows differ", "of 12 id(s), 12 have other texts (first: id '0')")
    assert not out.exists()
    code, err = run(train_argv(tiny, data, out, "poe", "--bias", bias, "--no-checkpoint"), capsys)  # the same rows
    assert code == 0, err
    noisy = tmp_path / "noisy"  # --label-noise flips training labels, not the rows the bias model was fitted on
    code, err = run(train_argv(tiny, data, noisy, "poe", "--bias", bias, "--no-checkpoint", "--label-noise", 0.5),
                    capsys)
    assert code == 0, err


@pytest.mark.parametrize("seed", ["-5", "5000000000", "1.5", "x"])
def test_seeds_outside_numpy_range_are_refused_by_every_subcommand(tiny, tmp_path, capsys, seed):
    commands = {
        "train": ["train", "--task", "nli", "--method", "erm", "--model", tiny],
        "mediation": ["mediation", "--model", tiny, "--task", "nli", "--out", tmp_path / "m"],
        "mask": ["mask", "--model", tiny, "--nie", tmp_path, "--out", tmp_path / "m"],
        "unlearn": ["unlearn", "--model", tiny, "--nie", tmp_path, "--bias", tmp_path, "--out", tmp_path / "m"],
    }
    for name, argv in commands.items():
        code, err = run(argv + ["--seed", seed], capsys)
        one_line_error(code, err, f"argument --seed: expected an integer in [0, {2**32 - 1}], got '{seed}'")
    assert cli.build_parser().parse_args(commands["train"] + ["--seed", str(2**32 - 1)]).seed == 2**32 - 1


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "big"])
def test_bias_fit_C_must_be_finite_and_positive(tmp_path, capsys, value):
    code, err = run(["bias", "fit", "--kind", "overlap", "--task", "nli", "--C", value, "--out", tmp_path / "b"],
                    capsys)
    one_line_error(code, err, f"argument --C: expected a finite number > 0, got '{value}'")
    assert not (tmp_path / "b").exists()


def _train_args(*extra):
    return cli.build_parser().parse_args(["train", "--task", "nli", "--method", "erm", *extra])


def test_weight_decay_must_keep_adamw_decay_factor_positive(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run(["train", "--task", "nli", "--method", "erm", "--model", tiny, "--weight-decay", "1e10",
                     "--out", out], capsys)
    one_line_error(code, err, "--weight-decay 1e+10 with --lr 5e-05", "expected --lr x --weight-decay < 1")
    assert not out.exists()
    with pytest.raises(cli.CliError, match="--weight-decay 10 with --lr 0.1"):
        check_options(_train_args("--lr", "0.1", "--weight-decay", "10"))
    check_options(_train_args("--lr", "0.1", "--weight-decay", "9.9"))


def test_report_to_names_must_be_known_and_installed(tiny, tmp_path, capsys):
    from transformers.integrations import integration_utils as hf

    out = tmp_path / "out"
    code, err = run(["train", "--task", "nli", "--method", "erm", "--model", tiny, "--report-to", "foo",
                     "--out", out], capsys)
    one_line_error(code, err, "--report-to: 'foo' is not a logging integration", "wandb")
    assert not out.exists()
    absent = [n for n in hf.INTEGRATION_TO_CALLBACK if n not in hf.get_available_reporting_integrations()]
    if absent:
        with pytest.raises(cli.CliError, match=f"--report-to: {absent[0]} is not available"):
            check_options(_train_args("--report-to", absent[0]))
    with pytest.raises(cli.CliError, match="'none' or 'all' alone"):
        check_options(_train_args("--report-to", "none", "tensorboard"))
    for ok in (["none"], ["all"], []):
        check_options(_train_args(*(["--report-to", *ok] if ok else [])))
