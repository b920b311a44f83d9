"""The objectives' declarations (`cat_fast.objectives.config`): a config saved as JSON builds the same objective,
requirements name their batch columns (kept out of the model's forward), and no layer above knows a method."""
import json
import pathlib
import re
from dataclasses import dataclass

import pytest
import torch

from cat_fast import models, objectives
from cat_fast.objectives import CAT, ERM, Objective, ObjectiveConfig, Requirement, option
from tests.conftest import tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[2] / "cat_fast"


def test_every_registered_config_round_trips_through_json():
    options = {"alpha": 0.5, "crm_clip": (0.9, 2.0), "cat_layers": [1], "gs_representation": "1", "gs_mode":
               "first_order", "entropy_weight": 0.1, "clp_scale": 2.0, "virtual_lr": 1e-3, "crm_lr": 1e-4}
    for name in objectives.names():
        config = objectives.get(name).cls.config
        saved = json.loads(json.dumps(config.from_options(options).to_dict()))
        assert config.from_options(saved) == config.from_options(options), name
        assert set(saved) == {o.name for o in config.options()}, name


def test_a_saved_config_builds_the_same_objective():
    model = tiny_model("bert", num_labels=2)
    flags = {"alpha": 0.5, "beta": 0.7, "crm_clip": (0.9, 2.0), "cat_layers": [1], "adv_steps": 2, "cat_update":
             "sum", "seed": 3}
    first = objectives.build("cat", model, options=flags)
    saved = json.loads(json.dumps(CAT.options_of(flags)))  # what metrics.json keeps
    again = objectives.build("cat", model, options={**saved, "seed": 3})
    for name in ("alpha", "beta", "a1", "a2", "layers", "adv_steps", "gamma", "eta", "adv_lr", "mask_mode", "update"):
        assert getattr(again, name) == getattr(first, name), name
    gs = objectives.build("gs", model, options=objectives.GradientSupervision.options_of({"gs_weight": 0.25}))
    assert gs.weight == 0.25 and gs.representation == "pooled"


def test_config_checks_name_the_field():
    with pytest.raises(ValueError, match=r"alpha: expected a finite number > 0, got 0"):
        objectives.CATConfig(alpha=0.0).check()
    with pytest.raises(ValueError, match=r"virtual_lr: expected a finite number > 0"):
        objectives.CLPConfig(virtual_lr=-1.0).check()
    objectives.CATConfig().check()


def test_requirements_declare_the_batch_columns():
    assert {"pairs", "pair_group", "bias", "teacher_probs", "context_mask"} <= set(objectives.batch_columns())
    assert [n for n in objectives.names() if objectives.BIAS in objectives.get(n).cls.requires] == [
        "poe", "reweight", "reweight-inverse", "learned-mixin", "conf-reg"]
    assert objectives.get("conf-reg").cls.needs_teacher and objectives.get("clp").cls.needs_meta

    @dataclass
    class WeightedConfig(ObjectiveConfig):
        strength: float = option(1.0, low=0.0, help="weight")

    class Weighted(Objective):  # a new requirement: its column is never passed to the model
        config = WeightedConfig
        requires = (Requirement("weights", ("example_weight",)),)

        def __init__(self, model, strength=1.0):
            super().__init__(model)
            self.strength = strength

        def __call__(self, batch):
            return (self.plain_forward(models.model_inputs(batch)).logits.sum() * batch["example_weight"].sum(),
                    {})

    assert "example_weight" in models.TARGET_KEYS and "example_weight" in objectives.batch_columns()
    model = tiny_model("bert", num_labels=2)
    made = Weighted.from_options(model, {"strength": 3.0, "alpha": 9.0})  # the config's fields only
    assert made.strength == 3.0
    batch = {"input_ids": torch.tensor([[2, 5, 3]]), "attention_mask": torch.ones(1, 3, dtype=torch.long),
             "labels": torch.tensor([1]), "example_weight": torch.tensor([2.0])}
    loss, _ = made(batch)
    assert torch.isfinite(loss)
    assert isinstance(ERM(model)(batch)[0], torch.Tensor)  # ERM leaves the declared column out too


def test_no_layer_above_the_objectives_probes_a_method():
    pattern = re.compile(r"needs_bias|needs_meta|needs_teacher|needs_pairs|inspect\.signature")
    files = sorted((ROOT / "cli").glob("*.py")) + sorted((ROOT / "integrations").glob("*.py")) + [
        ROOT / "objectives" / "base.py"]
    found = [f"{f.name}:{i}" for f in files for i, line in enumerate(f.read_text().splitlines(), 1)
             if pattern.search(line)]
    assert found == []
