"""cat_fast.objectives: the Objective base and the registry that the CLI and the Trainer classes share."""
import pytest
import torch

from cat_fast import objectives
from cat_fast.objectives import CAT, ERM, GradientSupervision, Objective
from tests.conftest import tiny_batch, tiny_model


def test_the_registry_names_every_method_of_the_cli():
    assert objectives.names() == ("erm", "erm-orig", "erm-two-step", "cat", "cat-star", "cat-gs", "gs", "gs-random", "poe",
                                  "reweight", "reweight-inverse", "learned-mixin", "conf-reg", "clp", "clp-all")
    assert objectives.get("erm-orig").data == "orig" and objectives.get("erm").data == "orig+edits"
    assert objectives.get("clp").data == objectives.get("clp-all").data == "orig"  # the edits go to the metadata
    assert [n for n in objectives.names() if objectives.get(n).warmup] == ["erm-two-step", "cat", "cat-star", "cat-gs"]
    assert [n for n in objectives.names() if objectives.get(n).cls.needs_pairs] == ["gs", "gs-random"]
    assert [n for n in objectives.names() if objectives.get(n).eager_attention] == ["cat-gs", "gs", "gs-random",
                                                                                   "clp-all"]


def test_build_applies_the_preset_then_the_options_then_the_arguments():
    model = tiny_model("bert", num_labels=2)
    star = objectives.build("cat-star", model)
    assert isinstance(star, CAT) and star.adv_steps == 0 and star.gs_weight == 0
    assert objectives.build("cat", model).adv_steps == 3
    both = objectives.build("cat-gs", model, options={"gs_weight": 0.5, "alpha": 2.0, "cat_layers": [2]})
    assert both.gs_weight == 0.5 and both.alpha == 2.0 and both.layers == [2] and both.adv_steps == 3
    assert objectives.build("cat", model, options={"gs_weight": 0.5}).gs_weight == 0  # GS only where the preset has it
    assert objectives.build("cat", model, options={"adv_steps": None}).adv_steps == 3  # None keeps the preset
    assert objectives.build("cat-star", model, options={"adv_steps": 2}).adv_steps == 2
    alternate = objectives.build("cat", model, options={"cat_update": "alternate", "crm_lr": 1e-4})
    assert alternate.update == "alternate" and alternate.crm_optimizer.param_groups[0]["lr"] == 1e-4
    assert objectives.build("cat", model, adv_steps=1).adv_steps == 1
    rand = objectives.build("gs-random", model, options={"gs_weight": 0.25, "seed": 3})
    assert isinstance(rand, GradientSupervision) and rand.random_pairs and rand.weight == 0.25
    assert isinstance(objectives.build("erm", model, options={"seed": 0}), ERM)


def test_seeded_options_make_the_same_draws():
    model = tiny_model("bert", num_labels=2).train()
    batch = tiny_batch("bert", batch=4, num_labels=2)
    runs = []
    for _ in range(2):
        cat = objectives.build("cat", model, options={"seed": 7, "cat_layers": [1, 2]})
        torch.manual_seed(0)
        _, info = cat(batch)
        runs.append((float(info["layer"]), float(info["lambda_before"])))
    assert runs[0] == runs[1]


def test_erm_is_the_models_own_loss():
    model = tiny_model("bert", num_labels=3).eval()
    batch = dict(tiny_batch("bert", batch=4), pairs=torch.tensor([1, 0, -1, -1]))
    loss, info = ERM(model)(batch)
    want = model(**{k: v for k, v in batch.items() if k != "pairs"}).loss
    torch.testing.assert_close(loss, want)
    assert info == {}


def test_objective_state_and_registration_errors():
    model = tiny_model("bert", num_labels=2)
    cat = CAT(model)
    cat.step = 5
    other = CAT(model)
    other.load_state_dict(cat.state_dict())
    assert other.step == 5 and list(cat.parameters()) == []
    with pytest.raises(ValueError, match="objective: expected one of erm, erm-orig"):
        objectives.get("nope")
    with pytest.raises(ValueError, match="'cat' is registered already"):
        objectives.register("cat", CAT, "again")
    with pytest.raises(TypeError, match="cls: expected a subclass"):
        objectives.register("plain", object, "not an objective")
    with pytest.raises(ValueError, match="data: expected"):
        objectives.register("odd", ERM, "odd data", data="edits")

    class Custom(Objective):
        def __call__(self, batch):
            return torch.zeros(()), {}

    assert Custom(model).state_dict() == {"step": 0}
    with pytest.raises(NotImplementedError):
        Objective(model)({})


def test_erm_two_step_is_two_adamw_updates_per_batch():
    """erm-two-step (the equal-update control of CAT's alternating update): after the warm-up, one AdamW step on the
    batch's loss with its own optimizer, then the loss of the updated model, returned; the caller's .grad untouched.
    Equal to that composition written out."""
    import copy

    model = tiny_model("bert", num_labels=3, dtype=torch.float64).eval()
    twin = copy.deepcopy(model)
    batch = {k: v for k, v in tiny_batch("bert", batch=4).items() if k != "pairs"}
    objective = objectives.build("erm-two-step", model, options={"crm_lr": 1e-3}, warmup_steps=1)
    assert objective.extra_optimizer.param_groups[0]["lr"] == 1e-3
    loss, info = objective(batch)  # step 1: warm-up, plain ERM, nothing moves
    assert info == {} and torch.equal(loss, twin(**batch).loss)
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    loss, info = objective(batch)  # step 2: the extra update, then the updated model's loss
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in model.parameters())  # caller's grads kept
    manual = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    first = twin(**batch).loss
    first.backward()
    manual.step()
    torch.testing.assert_close(info["extra_step_loss"], first.detach())
    torch.testing.assert_close(loss, twin(**batch).loss)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
    assert objectives.get("erm-two-step").warmup
