"""The Trainer's own controls through ``cat-fast train``: its optimizers and schedules, dev evaluation every N steps,
the best model kept, early stopping, checkpoints kept, and the Trainer's flag names."""
import json
import os

import pytest
import torch

from cat_fast import cli
from tests.cli.conftest import run
from tests.cli.test_own_data import own, rows, write_csv


def _metrics(out):
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture
def logged(monkeypatch):
    """Every log dict of the Trainer, and the optimizer it made."""
    from cat_fast.integrations import trainer as T

    seen = {"logs": [], "optimizers": []}
    real_log, real_opt = T.ObjectiveTrainer.log, T.ObjectiveTrainer.create_optimizer

    def log(self, logs, *a, **k):
        seen["logs"].append(dict(logs))
        return real_log(self, logs, *a, **k)

    def create_optimizer(self, *a, **k):
        made = real_opt(self, *a, **k)
        seen["optimizers"].append(made)
        return made

    monkeypatch.setattr(T.ObjectiveTrainer, "log", log)
    monkeypatch.setattr(T.ObjectiveTrainer, "create_optimizer", create_optimizer)
    return seen


def test_schedule_and_optimizer_are_the_trainers(tiny, tmp_path, capsys, logged):
    train = write_csv(tmp_path / "train.csv", rows(16))
    code, err = run(own(tiny, train, tmp_path / "c", "--lr-scheduler-type", "constant_with_warmup", "--warmup-steps", 2,
                        "--lr", "1e-3", "--optim", "sgd", "--no-checkpoint"), capsys)
    assert code == 0, err
    lrs = [h["learning_rate"] for h in logged["logs"] if "learning_rate" in h]
    assert lrs[:3] == pytest.approx([0.0, 5e-4, 1e-3]) and lrs[-1] == pytest.approx(1e-3)  # warm-up, then constant
    assert isinstance(logged["optimizers"][0], torch.optim.SGD)
    code, err = run(own(tiny, train, tmp_path / "bad", "--optim", "magic"), capsys)
    assert code == 2 and "--optim: expected one of the Trainer's optimizers" in err


def test_default_schedule_decays_linearly_to_zero(tiny, tmp_path, capsys, logged):
    train = write_csv(tmp_path / "train.csv", rows(16))
    assert run(own(tiny, train, tmp_path / "d", "--epochs", 1, "--no-checkpoint"), capsys)[0] == 0
    lrs = [h["learning_rate"] for h in logged["logs"] if "learning_rate" in h]
    assert lrs == pytest.approx([5e-5 * (4 - s) / 4 for s in range(4)])  # 16 rows / batch 4: 4 steps
    assert type(logged["optimizers"][0]).__name__ == "AdamW"
    groups = logged["optimizers"][0].param_groups
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]


def test_eval_steps_keep_best_and_early_stopping(tiny, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", rows(32))
    dev = write_csv(tmp_path / "dev.csv", rows(12, seed=1))
    out = tmp_path / "best"
    code, err = run(own(tiny, train, out, "--dev", dev, "--eval-steps", 2, "--keep-best", "--lr", "3e-3", "--epochs", 3),
                    capsys)
    assert code == 0, err
    m = _metrics(out)
    steps = [e["step"] for e in m["evaluations"]]
    assert steps == sorted(set(steps)) and {2, 4, 6, 8}.issubset(steps)  # every 2 steps and each epoch end
    top = max(e["dev_accuracy"] for e in m["evaluations"])
    assert m["best"]["dev_accuracy"] == top and m["best"]["kept"] and m["eval"]["dev"]["accuracy"] == top
    assert cli.main(["eval", "--model", str(out), "--eval", f"again={dev}"]) == 0  # the saved model is the best one
    assert json.loads(capsys.readouterr().out)["eval"]["again"]["accuracy"] == top

    stop = tmp_path / "stop"  # lr 0: the dev accuracy never improves after the first evaluation
    code, err = run(own(tiny, train, stop, "--dev", dev, "--eval-steps", 1, "--early-stopping-patience", 2, "--lr", 0),
                    capsys)
    assert code == 0, err
    m = _metrics(stop)
    assert m["steps"] == 3 and m["best"]["early_stopped_at"] == 3 and len(m["evaluations"]) == 3
    code, err = run(own(tiny, train, tmp_path / "x", "--keep-best"), capsys)  # own data without --dev: no dev set
    assert code == 2 and "need a dev set" in err and not (tmp_path / "x").exists()


def test_keep_checkpoints(tiny, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", rows(16))
    out = tmp_path / "k"
    code, err = run(own(tiny, train, out, "--epochs", 1, "--save-steps", 1, "--save-total-limit", 2,
                        "--keep-checkpoints"), capsys)
    assert code == 0 and "checkpoints kept" in err
    kept = sorted(n for n in os.listdir(str(out) + ".checkpoints") if n.startswith("checkpoint-"))
    assert kept == ["checkpoint-3", "checkpoint-4"]


def test_the_trainers_flag_names_are_aliases():
    a = cli.build_parser().parse_args(["train", "--method", "erm", "--model_name_or_path", "m", "--output_dir", "o",
                                       "--learning_rate", "1e-4", "--per_device_train_batch_size", "4",
                                       "--num_train_epochs", "2", "--train_file", "t.csv"])
    assert (a.model, a.out, a.lr, a.batch_size, a.epochs, a.train) == ("m", "o", 1e-4, 4, 2, ["t.csv"])


def test_an_objectives_own_parameters_are_trained(tmp_path):
    """learned-mixin's gate is in the Trainer's optimizer (it was left out of ObjectiveTrainer's)."""
    datasets = pytest.importorskip("datasets")
    from transformers import TrainingArguments

    from cat_fast.integrations import ObjectiveTrainer
    from tests.conftest import tiny_model

    n = 8
    g = torch.Generator().manual_seed(0)
    data = datasets.Dataset.from_dict({
        "input_ids": torch.randint(3, 100, (n, 8), generator=g).tolist(), "attention_mask": [[1] * 8] * n,
        "labels": [0, 1] * (n // 2), "bias": torch.log_softmax(torch.randn(n, 2, generator=g), -1).tolist()})
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2,
                             save_strategy="no", report_to=[], use_cpu=True)
    trainer = ObjectiveTrainer(model=tiny_model("bert", num_labels=2), args=args, train_dataset=data,
                               objective="learned-mixin")
    before = trainer.objective.gate.weight.detach().clone()
    trainer.train()
    assert not torch.equal(trainer.objective.gate.weight.detach(), before)
