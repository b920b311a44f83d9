"""A batch without the loss's targets (`Objective.target_keys`) is a ValueError naming the objective and the key,
raised before anything runs, for every objective and every entry point of a step (`__call__`, `plan_step`)."""
import pytest
import torch

from cat_fast import CAT, GradientSupervision, objectives

from ..conftest import tiny_batch, tiny_model


def _without(batch, *keys):
    return {k: v for k, v in batch.items() if k not in keys}


@pytest.mark.parametrize("name", [n for n in objectives.names() if not n.startswith("clp")])
def test_every_objective_names_the_missing_labels(name):
    model = tiny_model("bert", num_layers=2, num_labels=3)
    objective = objectives.build(name, model)
    batch = _without(tiny_batch("bert"), "labels")
    batch["bias"] = torch.randn(4, 3).log_softmax(-1)
    step = objective.step
    with pytest.raises(ValueError) as caught:
        objective(batch)
    who = type(objective).__name__
    assert str(caught.value).startswith(f"{who}: the batch has no 'labels'; {who} needs the model's inputs plus 'labels'")
    assert objective.step == step  # refused before the step counted


def test_cat_and_gs_plan_step_check_too():
    model = tiny_model("bert", num_layers=2, num_labels=3)
    batch = _without(tiny_batch("bert"), "labels")
    for objective in (CAT(model, warmup_steps=0), GradientSupervision(model, random_pairs=True)):
        with pytest.raises(ValueError, match="the batch has no 'labels'"):
            objective.plan_step(batch)


def test_cat_on_question_answering_needs_the_answer_span():
    model = tiny_model("bert", task="qa", num_layers=2)
    cat = CAT(model, warmup_steps=0)
    assert cat.target_keys() == ("start_positions", "end_positions")
    batch = _without(tiny_batch("bert"), "labels")
    batch["start_positions"] = torch.tensor([1, 2, 3, 1])
    with pytest.raises(ValueError, match="CAT: the batch has no 'end_positions'"):
        cat(batch)
