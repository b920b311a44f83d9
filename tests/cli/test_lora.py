"""``cat-fast train --lora R``: LoRA adapters (peft) and the head trained, the rest frozen, the merged model saved."""
import json
import os
import warnings

import pytest
import torch

from cat_fast.layers import training
from cat_fast.models.fast_layers import AdapterWarning
from tests.cli.conftest import run
from tests.cli.test_own_data import own, rows, write_csv

pytest.importorskip("peft")
safetensors = pytest.importorskip("safetensors.torch")


def test_lora_trains_adapters_and_head_and_saves_the_merged_model(tiny, tmp_path, capsys, monkeypatch):
    train = write_csv(tmp_path / "train.csv", rows(16))
    out = tmp_path / "lora"
    calls = []
    real = training._TrainingLayer.apply
    monkeypatch.setattr(training._TrainingLayer, "apply", lambda *a: calls.append(1) or real(*a))
    with warnings.catch_warnings():
        warnings.simplefilter("error", AdapterWarning)  # the fast layers read the LoRA projections: no warning
        code, err = run(own(tiny, train, out, "--lora", 4, "--lr", "1e-2", "--epochs", 1, "--method", "cat",
                            "--warmup-epochs", 0), capsys)
    assert code == 0, err
    assert calls  # the fast training layer ran over the adapted projections
    before = safetensors.load_file(os.path.join(tiny, "model.safetensors"))
    after = safetensors.load_file(os.path.join(out, "model.safetensors"))
    assert set(after) <= set(before) | {k for k in after if k.startswith("classifier")}
    assert not any("lora" in k for k in after)  # merged: a plain BERT
    changed = {k for k in after if k in before and before[k].shape == after[k].shape and not torch.equal(before[k], after[k])}
    layer0 = "bert.encoder.layer.0.attention.self."
    assert f"{layer0}query.weight" in changed and f"{layer0}value.weight" in changed  # peft's default targets
    assert f"{layer0}key.weight" not in changed and "bert.embeddings.word_embeddings.weight" not in changed
    meta = json.loads((out / "cat_fast.json").read_text())
    assert meta["lora"] == {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["query", "value"], "merged": True}


def test_lora_dropout_keeps_the_models_layers_and_says_so(tiny, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", rows(8))
    with pytest.warns(AdapterWarning, match=r"wrapped by peft .*lora_dropout 0\.1 in training mode"):
        code, err = run(own(tiny, train, tmp_path / "d", "--lora", 2, "--lora-dropout", 0.1, "--epochs", 1,
                            "--method", "cat", "--warmup-epochs", 0), capsys)
    assert code == 0, err


def test_lora_bad_target_is_one_line(tiny, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", rows(8))
    code, err = run(own(tiny, train, tmp_path / "x", "--lora", 2, "--lora-target-modules", "nope"), capsys)
    errors = [line for line in err.splitlines() if line.startswith("cat-fast: error:")]
    assert code == 2 and len(errors) == 1 and "--lora-target-modules nope" in errors[0]
    assert not (tmp_path / "x").exists()
