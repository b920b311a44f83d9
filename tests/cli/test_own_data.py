"""cat-fast on the user's own files (CSV, JSON Lines, save_to_disk), through the Hugging Face Trainer: labels, groups,
checkpoints and --resume, and the mistakes that must end in one line with exit 2 (or 3) and no output."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.cli.conftest import run, write_csv

datasets = pytest.importorskip("datasets")
safetensors = pytest.importorskip("safetensors.torch")

WORDS = ("good", "great", "fine", "bad", "awful", "poor", "ok", "plain", "movie", "film", "plot", "actor")


def rows(n=24, seed=0):
    """NLI-like pairs with string labels; rows 2k, 2k+1 form a counterfactual group with different labels."""
    g = torch.Generator().manual_seed(seed)
    labels = ("yes", "no", "maybe")
    out = []
    for i in range(n):
        words = [WORDS[int(j)] for j in torch.randint(len(WORDS), (6,), generator=g)]
        out.append({"id": f"ex{i}", "premise": " ".join(words), "hypothesis": " ".join(words[:3]),
                    "label": labels[(i // 2 + i % 2) % 3], "group": i // 2})
    return out


def write_jsonl(path, data):
    path.write_text("".join(json.dumps(r) + "\n" for r in data), encoding="utf-8")
    return str(path)


def own(tiny, train, out, *extra, method="erm"):
    return ["train", "--train", train, "--text-column", "premise", "--text-pair-column", "hypothesis",
            "--label-column", "label", "--method", method, "--model", tiny, "--epochs", 2, "--batch-size", 4,
            "--max-length", 24, "--cat-layers", 1, "--out", out, *extra]


def test_csv_with_groups_trains_gs_and_evaluates(tiny, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", rows(), bom=True)
    dev = write_jsonl(tmp_path / "dev.jsonl", rows(9, seed=1))
    out = tmp_path / "gs"
    code, err = run(own(tiny, train, out, "--group-column", "group", "--dev", dev, method="gs"), capsys)
    assert code == 0, err
    m = json.loads((out / "metrics.json").read_text())
    assert m["labels"] == ["maybe", "no", "yes"] and m["task"] == "custom"
    assert m["data"]["n_train"] == 24 and m["data"]["groups"] == 12
    assert set(m["eval"]) == {"dev"} and m["eval"]["dev"]["n"] == 9
    assert all(h["info"]["gs_pairs"] > 0 for h in m["history"])  # groups kept in one batch: pairs every step
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {"0": "maybe", "1": "no", "2": "yes"}
    # eval reads the checkpoint's columns and labels
    from cat_fast import cli

    assert cli.main(["eval", "--model", str(out), "--eval", f"again={dev}"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["eval"]["again"] == m["eval"]["dev"] and printed["task"] == "custom"


def test_jsonl_and_save_to_disk(tiny, tmp_path, capsys):
    data = rows()
    jsonl = write_jsonl(tmp_path / "train.jsonl", data)
    disk = tmp_path / "train_ds"
    datasets.Dataset.from_list(data).save_to_disk(str(disk))
    for name, path in (("jsonl", jsonl), ("disk", str(disk))):
        code, err = run(own(tiny, path, tmp_path / name, "--epochs", 1, "--no-checkpoint"), capsys)
        assert code == 0, (name, err)
    a = json.loads((tmp_path / "jsonl" / "metrics.json").read_text())
    b = json.loads((tmp_path / "disk" / "metrics.json").read_text())
    assert a["history"][0]["train_loss"] == pytest.approx(b["history"][0]["train_loss"], rel=1e-6)


def _weights(directory):
    return safetensors.load_file(os.path.join(directory, "model.safetensors"))


def test_resume_matches_an_uninterrupted_run(tiny, tmp_path, capsys, monkeypatch):
    train = write_csv(tmp_path / "train.csv", rows(32))
    args = lambda out: own(tiny, train, out, "--save-steps", 3, "--epochs", 3, "--group-column", "group",  # noqa: E731
                           method="cat")
    assert run(args(tmp_path / "full"), capsys)[0] == 0
    assert not os.path.exists(str(tmp_path / "full") + ".checkpoints")  # removed once the run is complete

    from transformers import TrainerCallback

    from cat_fast.integrations import trainer as cli_train

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 7:
                raise KeyboardInterrupt

    real = cli_train.ObjectiveTrainer.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        self.add_callback(Stop())

    monkeypatch.setattr(cli_train.ObjectiveTrainer, "__init__", init)
    code, err = run(args(tmp_path / "cut"), capsys)
    assert code == 130 and "--resume" in err and not os.path.exists(tmp_path / "cut")
    assert sorted(os.listdir(str(tmp_path / "cut") + ".checkpoints")) == [".cat-fast", "cat_fast_run.json", "checkpoint-3",
                                                                              "checkpoint-6"]
    monkeypatch.setattr(cli_train.ObjectiveTrainer, "__init__", real)
    code, err = run(args(tmp_path / "cut") + ["--resume"], capsys)
    assert code == 0, err
    full, cut = _weights(tmp_path / "full"), _weights(tmp_path / "cut")
    for k in full:
        torch.testing.assert_close(cut[k], full[k], rtol=1e-6, atol=1e-6, msg=k)
    mf = json.loads((tmp_path / "full" / "metrics.json").read_text())
    mc = json.loads((tmp_path / "cut" / "metrics.json").read_text())
    assert mc["eval"] == mf["eval"] and mc["steps"] == mf["steps"]
    for a, b in zip(mf["history"], mc["history"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)


@pytest.mark.parametrize("extra, message", [
    (["--gamma", "inf"], "--gamma must be a finite number"),
    (["--adv-lr", "nan"], "--adv-lr must be a finite number"),
    (["--max-grad-norm", "-1"], "--max-grad-norm must be a finite number >= 0"),
    (["--alpha", "-5"], "--alpha must be a finite number > 0"),
    (["--gs-weight", "-1"], "--gs-weight must be a finite number >= 0"),
    (["--crm-lr", "-1"], "--crm-lr must be a finite number >= 0"),
    (["--cat-layers", "99"], "layers: expected mixing layers within [0, 2]"),
    (["--max-length", "1"], "--max-length must be at least 5"),
    (["--max-length", "100000"], "at most 512"),
    (["--ddp-bucket-mb", "0"], "--ddp-bucket-mb: expected a positive integer, got '0'"),
])
def test_bad_options_exit_2_with_one_line(tiny, tmp_path, capsys, extra, message):
    train = write_csv(tmp_path / "train.csv", rows())
    out = tmp_path / "o"
    code, err = run(own(tiny, train, out, *extra, method="cat"), capsys)
    lines = [line for line in err.strip().splitlines() if "classification head" not in line]  # the new-head note
    assert code == 2 and message in err and len(lines) == 1, err
    assert not os.path.exists(out) and not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_ddp_bucket_size_in_one_process_warns_that_it_does_nothing(tiny, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", rows(8))
    code, err = run(own(tiny, train, tmp_path / "o", "--ddp-bucket-mb", 8, "--epochs", 1), capsys)
    assert code == 0, err
    assert "cat-fast: warning: --ddp-bucket-mb has no effect in one process" in err


def test_non_finite_loss_stops_with_exit_3(tiny, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", rows())
    out = tmp_path / "o"
    code, err = run(own(tiny, train, out, "--lr", "1e30", "--weight-decay", "0", "--max-grad-norm", "0", "--epochs", 3),
                    capsys)
    errors = [line for line in err.split("\n") if "cat-fast: error:" in line]  # the progress bar shares stderr
    assert code == 3 and len(errors) == 1 and "at step" in errors[0], err
    assert not os.path.exists(out)


def test_model_without_tokenizer_is_refused(tiny, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        os.link(os.path.join(tiny, f), bare / f)
    train = write_csv(tmp_path / "train.csv", rows())
    code, err = run(own(str(bare), train, tmp_path / "o"), capsys)
    assert code == 2 and "no tokenizer files" in err


def test_overwrite_never_deletes_the_working_directory_or_an_input(tiny, tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    train = write_csv(data / "train.csv", rows())
    (data / ".cat-fast").write_text("x")  # even a marked directory that holds an input
    code, err = run(own(tiny, train, data, "--overwrite"), capsys)
    assert code == 2 and "holds the input" in err and os.path.exists(train)
    monkeypatch.chdir(data)
    code, err = run(own(tiny, train, ".", "--overwrite"), capsys)
    assert code == 2 and "holds the working directory" in err and os.path.exists(train)


def test_sigterm_leaves_nothing_and_says_so(tiny, tmp_path):
    train = write_csv(tmp_path / "train.csv", rows(200))
    out = tmp_path / "o"
    argv = [sys.executable, "-c", "import sys; from cat_fast.cli import main; sys.exit(main())"]
    proc = subprocess.Popen(argv + [str(a) for a in own(tiny, train, out, "--epochs", 50)], stderr=subprocess.PIPE,
                            text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    import time

    deadline = time.time() + 120
    while time.time() < deadline and not [p for p in os.listdir(tmp_path) if p.startswith(".o.tmp-")]:
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted" in err
    assert not os.path.exists(out) and not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_bias_fit_then_poe_with_the_hans_preset(tiny, tmp_path, capsys):
    bias = tmp_path / "bias"
    code, err = run(["bias", "fit", "--kind", "overlap", "--task", "nli", "--out", bias], capsys)
    assert code == 0, err
    meta = json.loads((bias / "bias_meta.json").read_text())
    assert meta["n"] == 8330 and meta["train_accuracy"] > 0.40  # above the class prior of CAD NLI train
    out = tmp_path / "poe"
    argv = ["train", "--task", "nli", "--method", "poe", "--bias", bias, "--model", tiny, "--per-class", 4,
            "--epochs", 1, "--max-length", 32, "--batch-size", 8, "--eval", "hans", "--out", out, "--no-checkpoint"]
    code, err = run(argv, capsys)
    assert code == 0, err
    m = json.loads((out / "metrics.json").read_text())
    assert m["eval"]["hans"]["n"] == 3000 and m["eval"]["hans/lexical_overlap/entailment"]["n"] == 500
    assert "poe_loss" in m["history"][0]["info"] and not any(k.startswith("dev") for k in m["history"][0]["info"])
    code, err = run(argv[:5] + argv[7:-3] + ["--out", tmp_path / "poe2"], capsys)  # without --bias
    assert code == 2 and "needs --bias FILE" in err
