"""``cat-fast train --trainer-args --FIELD VALUE ...``: the Trainer's other TrainingArguments fields, parsed by
HfArgumentParser, reaching the run's Trainer and recorded with its options; fields cat-fast sets or controls, bad
values and unknown names refused in one line before anything is written; a --resume with other fields refused."""
import json

import pytest

from cat_fast import cli
from tests.cli.conftest import run
from tests.cli.test_own_data import own, rows, write_csv


@pytest.fixture
def seen(monkeypatch):
    """The TrainingArguments and the optimizer of each Trainer made, and every log dict."""
    from cat_fast.integrations import trainer as T

    got = {"args": [], "optimizers": [], "logs": []}
    real_opt, real_log = T.ObjectiveTrainer.create_optimizer, T.ObjectiveTrainer.log

    def create_optimizer(self, *a, **k):
        made = real_opt(self, *a, **k)
        got["args"].append(self.args)
        got["optimizers"].append(made)
        return made

    def log(self, logs, *a, **k):
        got["logs"].append(dict(logs))
        return real_log(self, logs, *a, **k)

    monkeypatch.setattr(T.ObjectiveTrainer, "create_optimizer", create_optimizer)
    monkeypatch.setattr(T.ObjectiveTrainer, "log", log)
    return got


def _one_error(err):
    lines = [line for line in err.splitlines() if line.startswith("cat-fast: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_fields_reach_the_trainer_and_metrics(tiny, tmp_path, capsys, seen):
    train = write_csv(tmp_path / "train.csv", rows(16))
    out = tmp_path / "p"
    code, err = run(own(tiny, train, out, "--epochs", 1, "--no-checkpoint", "--lr-scheduler-type", "polynomial",
                        "--lr", "1e-3", "--trainer-args", "--adam_beta2", "0.98", "--lr_scheduler_kwargs",
                        '{"power": 2.0}', "--dataloader_num_workers", "1"), capsys)
    assert code == 0, err
    targs, optimizer = seen["args"][0], seen["optimizers"][0]
    assert (targs.adam_beta2, targs.lr_scheduler_kwargs, targs.dataloader_num_workers) == (0.98, {"power": 2.0}, 1)
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.98)
    lrs = [h["learning_rate"] for h in seen["logs"] if "learning_rate" in h]  # 4 steps of a quadratic decay
    assert lrs == pytest.approx([(1e-3 - 1e-7) * (1 - s / 4) ** 2 + 1e-7 for s in range(4)])
    config = json.loads((out / "metrics.json").read_text())["config"]
    assert config["trainer_args"] == {"adam_beta2": 0.98, "lr_scheduler_kwargs": {"power": 2.0},
                                      "dataloader_num_workers": 1}
    assert config["lr_scheduler_type"] == "polynomial"


def test_without_it_the_trainers_defaults(tiny, tmp_path, capsys, seen):
    train = write_csv(tmp_path / "train.csv", rows(8))
    out = tmp_path / "d"
    assert run(own(tiny, train, out, "--epochs", 1, "--no-checkpoint"), capsys)[0] == 0
    assert seen["args"][0].adam_beta2 == 0.999 and seen["optimizers"][0].param_groups[0]["betas"] == (0.9, 0.999)
    assert json.loads((out / "metrics.json").read_text())["config"]["trainer_args"] is None


@pytest.mark.parametrize("fields, said", [
    (["--learning_rate", "1e-3"], "--trainer-args --learning_rate: cat-fast sets it from --lr"),
    (["--adam_beta1", "0.8", "--seed", "3"], "--trainer-args --seed: cat-fast sets it from --seed"),
    (["--per-device-train-batch-size", "2"], "--per_device_train_batch_size: cat-fast sets it from --batch-size"),
    (["--report_to", "none"], "cat-fast sets it from --report-to"),
    (["--save_strategy", "epoch"], "--trainer-args --save_strategy: cat-fast controls it: checkpoints are written "
                                   "every --save-steps"),
    (["--remove_unused_columns", "true"], "--remove_unused_columns: cat-fast controls it: the batches carry"),
    (["--hub_token", "secret"], "--hub_token: cat-fast controls it"),
    (["--adam_beta2", "x"], "--trainer-args: argument --adam_beta2/--adam-beta2: invalid float value: 'x'"),
    (["--adam_beta2", "nan"], "--trainer-args --adam_beta2: expected a finite number, got nan"),
    (["--adam_beta2", "1.5"], "--trainer-args --adam_beta2 1.5: Invalid beta parameter"),  # the optimizer's check
    (["--lr_scheduler_kwargs", "{power"], "--trainer-args --lr_scheduler_kwargs {power: Expecting property name"),
    (["--lr_scheduler_kwargs", '{"power": 2}'], "--trainer-args --lr_scheduler_kwargs"),  # linear takes no power
    (["--dataloader_persistent_workers"], "--dataloader_persistent_workers: needs --dataloader_num_workers above 0"),
    (["--adam_betaa", "0.9"], "--trainer-args: --adam_betaa is not a field of transformers.TrainingArguments"),
    (["--adam_beta2", "0.9", "--epochs", "2"], "--epochs is not a field of transformers.TrainingArguments"),
    (["--adam_beta2", "0.9", "0.8"], "--trainer-args: unexpected value '0.8'"),
    ([], "--trainer-args: expected TrainingArguments fields after it"),
])
def test_refused_in_one_line_before_anything_is_written(tiny, tmp_path, capsys, fields, said):
    train = write_csv(tmp_path / "train.csv", rows(8))
    out = tmp_path / "x"
    code, err = run(own(tiny, train, out, "--epochs", 1, "--trainer-args", *fields), capsys)
    line = _one_error(err)
    assert code == 2 and said in line and not out.exists(), line


def test_resume_refuses_other_fields(tiny, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", rows(8))
    out = tmp_path / "r"

    def args(beta2, *extra):
        return own(tiny, train, out, "--epochs", 1, "--save-steps", 1, "--keep-checkpoints", *extra,
                   "--trainer-args", "--adam_beta2", beta2)

    code, err = run(args("0.98"), capsys)
    assert code == 0, err
    record = json.loads(open(str(out) + ".checkpoints/cat_fast_run.json").read())
    assert record["trainer_args"] == {"adam_beta2": 0.98}
    code, err = run(args("0.95", "--resume", "--overwrite"), capsys)
    line = _one_error(err)
    assert code == 2 and "--trainer-args (checkpoint: {\"adam_beta2\": 0.98}, now: {\"adam_beta2\": 0.95})" in line
    code, err = run(args("0.98", "--resume", "--overwrite"), capsys)  # the same fields: it resumes
    assert code == 0, err


def test_help_names_it(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["train", "--help"])
    assert "--trainer-args" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        cli.build_parser().parse_args(["train", "--method", "erm", "--trainer-args", "--help"])
    shown = capsys.readouterr().out
    assert stop.value.code == 0 and "--adam_beta2" in shown and "--lr_scheduler_kwargs" in shown
    assert "--learning_rate" not in shown and "--save_strategy" not in shown  # set or controlled by cat-fast
