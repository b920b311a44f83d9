"""`build` (and so the Trainer's ``objective="name"``) says which required argument is missing and what it is."""
import pytest
import torch

from cat_fast import objectives
from cat_fast.objectives import Objective
from tests.conftest import tiny_model


def test_clp_without_meta_batches_says_what_it_needs():
    with pytest.raises(ValueError, match=r"CLP needs meta_batches=\[\.\.\.\]: a small balanced metadata set as "
                                         r"tokenised batches.*objective_kwargs=\{'meta_batches': \.\.\.\}"):
        objectives.build("clp", tiny_model("bert", num_labels=2))


def test_any_required_argument_is_named():
    class Needs(Objective):
        def __init__(self, model, teacher, *, table):
            super().__init__(model)

        def __call__(self, batch):
            return torch.zeros(()), {}

    objectives.register("needs-two", Needs, "a test objective with two required arguments")
    try:
        with pytest.raises(ValueError, match=r"Needs needs teacher=\.\.\.; table=\.\.\. \(objective_kwargs="):
            objectives.build("needs-two", torch.nn.Linear(2, 2))
        with pytest.raises(ValueError, match=r"Needs needs table=\.\.\. "):
            objectives.build("needs-two", torch.nn.Linear(2, 2), teacher=1)
    finally:
        objectives.base._REGISTRY.pop("needs-two")


def test_trainer_objective_clp_names_meta_batches(tmp_path):
    pytest.importorskip("accelerate")
    from cat_fast.integrations import ObjectiveTrainer
    from tests.integrations.test_trainer import args, tiny_dataset

    with pytest.raises(ValueError, match="CLP needs meta_batches"):
        ObjectiveTrainer(model=tiny_model("bert", num_labels=2), args=args(tmp_path), train_dataset=tiny_dataset(),
                         objective="clp")
