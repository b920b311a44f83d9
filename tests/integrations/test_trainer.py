"""cat_fast.CATTrainer / GSTrainer: a tiny BERT trains a few steps with each on an in-memory dataset."""
import math

import pytest
import torch

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate>=1.1.0 (and psutil)")
datasets = pytest.importorskip("datasets")

from transformers import TrainingArguments  # noqa: E402

from cat_fast.integrations import CATTrainer, GSTrainer  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402


def tiny_dataset(n=8, length=8):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[1::2, -2:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = torch.tensor([0, 1] * (n // 2))
    return datasets.Dataset.from_dict({
        "input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist(),
        "pair_group": [i // 2 for i in range(n)],  # (0,1), (2,3), ...: counterfactual pairs, labels differ
        "unused_text": ["x"] * n,  # dropped by remove_unused_columns
    })


def args(tmp_path):
    return TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=3,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             seed=0, data_seed=0, dataloader_num_workers=0)


def run(trainer_cls, tmp_path, **kw):
    model = tiny_model("bert", num_labels=2).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = trainer_cls(model=model, args=args(tmp_path), train_dataset=tiny_dataset(), **kw)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    changed = [n for n, p in model.named_parameters() if (p.detach() - before[n]).abs().max() > 0]
    assert "classifier.weight" in changed and any("encoder.layer.0" in n for n in changed)
    return trainer


def test_cat_trainer_trains(tmp_path):
    trainer = run(CATTrainer, tmp_path, cat_kwargs={"layers": [2], "warmup_steps": 1,
                                                    "generator": torch.Generator().manual_seed(0)})
    logged = [h for h in trainer.state.log_history if "cat/crm_loss" in h]
    assert [h["cat/cat_active"] for h in logged] == [0.0, 1.0, 1.0]  # warm-up counted in optimizer steps


def test_gs_trainer_trains_with_pair_groups(tmp_path):
    trainer = run(GSTrainer, tmp_path, gs_kwargs={"weight": 1.0})
    logged = [h for h in trainer.state.log_history if "gs/gs_loss" in h]
    assert logged and all(h["gs/gs_pairs"] == 8.0 for h in logged)  # the batch holds all 4 pairs, both ways


def test_objective_trainer_takes_a_registered_name(tmp_path):
    from cat_fast.integrations import ObjectiveTrainer
    from cat_fast.objectives import CAT

    trainer = run(ObjectiveTrainer, tmp_path, objective="cat-star",
                  objective_kwargs={"layers": [2], "generator": torch.Generator().manual_seed(0)})
    assert isinstance(trainer.objective, CAT) and trainer.objective.adv_steps == 0
    assert any("objective/crm_loss" in h for h in trainer.state.log_history)
    with pytest.raises(ValueError, match="objective: expected one of"):
        ObjectiveTrainer(model=tiny_model("bert", num_labels=2), args=args(tmp_path), train_dataset=tiny_dataset(),
                         objective="nope")
