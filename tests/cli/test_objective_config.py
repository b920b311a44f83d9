"""``cat-fast train``'s objective options come from the objectives' configs: every output records them, a run is
repeated from a previous --out with --objective-config, and a registered config's flag is range-checked."""
import json
from dataclasses import dataclass

import pytest
import torch

from cat_fast import objectives
from cat_fast.objectives import Objective, ObjectiveConfig, option

from .conftest import run

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")


def _train(tiny, out, *extra, method="cat"):
    return ["train", "--task", "sentiment", "--method", method, "--model", tiny, "--per-class", 2, "--epochs", 2,
            "--max-length", 32, "--batch-size", 4, "--warmup-epochs", 1, "--out", out, *extra]


def test_outputs_record_the_config_and_a_run_repeats_from_it(tiny, tmp_path, capsys):
    first = tmp_path / "first"
    code, err = run(_train(tiny, first, "--alpha", 0.5, "--crm-clip", "0.9,2", "--cat-layers", "1,2",
                           "--save-steps", 1, "--keep-checkpoints"), capsys)
    assert code == 0, err
    record = json.loads((first / "metrics.json").read_text())["objective"]
    assert record["method"] == "cat" and record["class"] == "cat_fast.objectives.cat.CAT"
    assert record["options"]["alpha"] == 0.5 and record["options"]["crm_clip"] == [0.9, 2.0]
    assert record["options"]["cat_layers"] == [1, 2]
    assert json.loads((first / "cat_fast.json").read_text())["objective"] == record
    run_file = tmp_path / "first.checkpoints" / "cat_fast_run.json"
    assert json.loads(run_file.read_text())["objective"] == record

    again = tmp_path / "again"
    code, err = run(_train(tiny, again, "--objective-config", first, "--beta", 0.7), capsys)
    assert code == 0, err
    repeated = json.loads((again / "metrics.json").read_text())["objective"]
    assert repeated["options"] == {**record["options"], "beta": 0.7}  # the saved options, the flag given wins
    config = json.loads((again / "metrics.json").read_text())["config"]
    assert config["alpha"] == 0.5 and config["cat_layers"] == [1, 2]

    code, err = run(_train(tiny, tmp_path / "x", "--objective-config", first, method="gs"), capsys)
    assert code == 2 and "--objective-config" in err and "saved for --method cat, not --method gs" in err
    code, err = run(_train(tiny, tmp_path / "y", "--objective-config", tmp_path), capsys)
    assert code == 2 and "no metrics.json" in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_registered_config_gives_a_checked_flag(tiny, tmp_path, capsys):
    @dataclass
    class StrengthConfig(ObjectiveConfig):
        title = "strength"
        strength: float = option(1.0, low=0.0, low_open=True, help="a test option", flag="--test-strength")

    class Strength(Objective):
        config = StrengthConfig

        def __init__(self, model, strength=1.0):
            super().__init__(model)
            self.strength = strength

        def __call__(self, batch):
            return torch.zeros(()), {}

    objectives.register("test-strength", Strength, "a test objective with one option")
    try:
        code, err = run(_train(tiny, tmp_path / "o", "--test-strength", "0", method="test-strength"), capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1
        assert lines[0] == "cat-fast: error: --test-strength must be a finite number > 0, got 0.0"
        code, err = run(_train(tiny, tmp_path / "o", "--test-strength", "x", method="test-strength"), capsys)
        assert code == 2 and "--test-strength" in err
        assert not (tmp_path / "o").exists()
    finally:
        objectives.base._REGISTRY.pop("test-strength")
