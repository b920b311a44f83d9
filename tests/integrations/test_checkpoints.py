"""Checkpoints of `ObjectiveTrainer` are atomic: an interrupted save leaves the previous checkpoint complete, a
resume takes the newest complete checkpoint, and the objective's state is read without unpickling code."""
import json
import os

import pytest
import torch

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate>=1.1.0 (and psutil)")
datasets = pytest.importorskip("datasets")

from transformers import TrainingArguments  # noqa: E402

from cat_fast.integrations import ObjectiveTrainer  # noqa: E402
from cat_fast.integrations import checkpoints as ckpt  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.integrations.test_trainer import tiny_dataset  # noqa: E402


def make(tmp_path, max_steps=4, limit=1):
    model = tiny_model("bert", num_labels=2).train()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=max_steps,
                             learning_rate=1e-3, logging_steps=1, save_strategy="steps", save_steps=1,
                             save_total_limit=limit, report_to=[], use_cpu=True, seed=0, data_seed=0,
                             dataloader_num_workers=0)
    return ObjectiveTrainer(model=model, args=args, train_dataset=tiny_dataset(16), objective="cat-star",
                            objective_kwargs={"layers": [2], "generator": torch.Generator().manual_seed(0)})


class Interrupt(Exception):
    pass


def test_an_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """save_total_limit=1 and an interrupt while the objective's state of checkpoint 3 is written: checkpoint 2 is
    still there and complete, and no checkpoint-3 folder exists (the Trainer used to rotate checkpoint 2 away
    before that file was written)."""
    trainer = make(tmp_path)
    real = torch.save

    def save(obj, path, *a, **k):
        if str(path).endswith("cat_fast_objective.pt") and trainer.state.global_step == 3:
            raise Interrupt
        return real(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(Interrupt):
        trainer.train()
    names = sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint-"))
    assert names == ["checkpoint-2"] and ckpt.is_complete(str(tmp_path / "checkpoint-2"))
    assert ckpt.last_complete(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    monkeypatch.setattr(torch, "save", real)

    resumed = make(tmp_path)
    resumed.train(resume_from_checkpoint=True)  # the staging folder of step 3 is removed by the next save
    assert resumed.state.global_step == 4
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith("runs")) == ["checkpoint-4"]


def test_an_interrupted_rename_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    trainer = make(tmp_path, max_steps=2, limit=None)
    real = os.replace

    def replace(src, dst):
        if str(dst).endswith("checkpoint-2"):
            raise Interrupt
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Interrupt):
        trainer.train()
    assert [n for n in os.listdir(tmp_path) if n.startswith("checkpoint-")] == ["checkpoint-1"]
    assert ckpt.last_complete(str(tmp_path)).endswith("checkpoint-1")


def test_a_checkpoint_without_its_manifest_is_not_resumed(tmp_path):
    trainer = make(tmp_path, max_steps=2, limit=None)
    trainer.train()
    os.remove(tmp_path / "checkpoint-2" / ckpt.COMPLETE)
    assert ckpt.last_complete(str(tmp_path)).endswith("checkpoint-1")
    with pytest.raises(ckpt.CheckpointError, match="not a complete checkpoint"):
        make(tmp_path, max_steps=2).train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    truncated = tmp_path / "checkpoint-1" / "cat_fast_objective.pt"
    truncated.write_bytes(truncated.read_bytes()[:10])  # a size other than the manifest's
    assert ckpt.last_complete(str(tmp_path)) is None
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint"):
        make(tmp_path, max_steps=2).train(resume_from_checkpoint=True)


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_the_objective_state_is_loaded_without_running_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make(tmp_path, max_steps=1, limit=None).train()
    folder = tmp_path / "checkpoint-1"
    torch.save({"step": _Payload()}, folder / "cat_fast_objective.pt")
    manifest = json.loads((folder / ckpt.COMPLETE).read_text())  # the attacker rewrites the manifest too
    manifest["files"]["cat_fast_objective.pt"] = os.path.getsize(folder / "cat_fast_objective.pt")
    (folder / ckpt.COMPLETE).write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match="cannot read the objective's state"):
        make(tmp_path, max_steps=2).train(resume_from_checkpoint=str(folder))
    assert not (tmp_path / "PWNED").exists()
