"""cat_fast.CAT: Algorithm 1 end to end on tiny models (CMIX, CAL on λ only, CRM, updates, QA, CAT + GS)."""
import pytest
import torch
import torch.nn.functional as F

from cat_fast import models
from cat_fast.layers import first_token as first_token_layer
from cat_fast.objectives import CAT, default_layers
from tests.conftest import TINY_ARCHS, assert_same_cat_steps, cat_steps, tiny_batch, tiny_model

INFO_KEYS = {"erm_loss", "crm_loss", "lambda_before", "lambda_after", "crm_weight_mean", "cal_objective", "layer",
             "cat_active"}


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_default_layers_scale_the_paper_set_to_depth():
    assert default_layers(12) == [8, 9, 10]
    assert default_layers(6) == [4, 5]
    assert default_layers(24) == [16, 18, 20]
    assert default_layers(4) == [3]
    assert default_layers(2) == [1, 2]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_cat_step_trains_every_architecture(arch):
    model = tiny_model(arch).train()
    cat = CAT(model, generator=gen())
    loss, info = cat(tiny_batch(arch))
    assert set(info) == INFO_KEYS
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in info.values())
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss.detach(), info["erm_loss"] + info["crm_loss"])  # update="sum"
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and sum(float(g.abs().sum()) for g in grads) > 0
    assert float(info["cat_active"]) == 1.0 and float(info["layer"]) in cat.layers


def test_cal_optimises_lambda_only_and_ascends_the_objective():
    model = tiny_model("bert").eval()
    batch = tiny_batch("bert")
    kw = dict(layers=[2], adv_lr=1e-3, generator=None)
    cat0 = CAT(model, adv_steps=0, **{**kw, "generator": gen(3)})
    cat1 = CAT(model, adv_steps=1, **{**kw, "generator": gen(3)})
    _, _, info0 = cat0.losses(batch)
    _, _, info1 = cat1.losses(batch)
    assert all(p.grad is None for p in model.parameters())  # CAL never touches parameter gradients
    torch.testing.assert_close(info0["lambda_before"], info1["lambda_before"])  # same draws
    torch.testing.assert_close(info0["lambda_after"], info0["lambda_before"])  # CAT*: λ as sampled
    assert float(info1["lambda_after"]) != float(info1["lambda_before"])
    assert float(info1["cal_objective"]) > float(info0["cal_objective"])  # gradient ASCENT on J


def test_each_sample_gets_its_own_lambda_gradient(monkeypatch):
    model = tiny_model("bert").eval()
    batch = tiny_batch("bert", batch=6)
    seen = {}
    import cat_fast.objectives.cat as cat_module

    real_step, real_cmix = cat_module.cal_step_, cat_module.cmix

    def spy_step(lam, grad, lr, p=1.0, lo=0.0, hi=1.0):
        seen["grad"] = grad.clone()
        return real_step(lam, grad, lr, p, lo, hi)

    def spy_cmix(h, lam, partner, *a, **k):
        seen["partner"] = partner.clone()
        return real_cmix(h, lam, partner, *a, **k)

    monkeypatch.setattr(cat_module, "cal_step_", spy_step)
    monkeypatch.setattr(cat_module, "cmix", spy_cmix)
    CAT(model, layers=[2], adv_steps=1, generator=gen(2)).losses(batch)
    g, partner = seen["grad"], seen["partner"]
    assert g.shape == (6,)
    self_paired = partner == torch.arange(6)
    assert (g[self_paired] == 0).all()  # h̃_i = h_i: λ_i has no effect
    moving = g[~self_paired].tolist()
    assert len(moving) >= 3 and len(set(moving)) == len(moving) and all(v != 0 for v in moving)


def test_zero_lambda_makes_crm_equal_erm_in_train_mode(monkeypatch):
    model = tiny_model("bert", hidden_dropout_prob=0.3).train()
    cat = CAT(model, adv_steps=0, generator=gen(), prune_last_layer=False)
    monkeypatch.setattr(cat, "_draw_lambda", lambda B, device, dtype: torch.zeros(B, device=device, dtype=dtype))
    erm, crm, info = cat.losses(tiny_batch("bert"))
    torch.testing.assert_close(info["crm_weight_mean"], torch.tensor(1.0))  # same dropout masks: ω = 1 exactly
    torch.testing.assert_close(crm, erm)


def _count_first_token_calls(monkeypatch):
    calls = []
    real = first_token_layer.forward

    def spy(mod, args, kwargs, fill=None, row_only=False, input_only=False):
        out = real(mod, args, kwargs, fill, row_only, input_only=input_only)
        calls.append(out is not None)
        if out is not None:  # a counterfactual pass hands the head one row; the clean forward a whole sequence
            assert (out.shape[1] == 1) == row_only and out.shape[1] == (1 if row_only else args[0].shape[1])
        return out

    monkeypatch.setattr(first_token_layer, "forward", spy)
    return calls


def test_pruned_last_layer_keeps_the_clean_dropout_in_train_mode(monkeypatch):
    # The clean forward and the counterfactual passes run the same first-token last layer, so they draw the same
    # dropout masks in every layer: λ = 0 gives ω = 1 and CRM = ERM exactly, with dropout on.
    model = tiny_model("bert", hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3).train()
    cat = CAT(model, layers=[1], adv_steps=0, generator=gen())
    monkeypatch.setattr(cat, "_draw_lambda", lambda B, device, dtype: torch.zeros(B, device=device, dtype=dtype))
    assert models.first_token_ready(model, tiny_batch("bert"))  # the once-per-model check, before counting
    calls = _count_first_token_calls(monkeypatch)
    erm, crm, info = cat.losses(tiny_batch("bert"))
    assert calls == [True, True]  # the clean forward and the final counterfactual pass
    torch.testing.assert_close(info["crm_weight_mean"], torch.tensor(1.0))
    torch.testing.assert_close(crm, erm)


def test_cat_with_gs_runs_the_full_last_layer_in_the_clean_forward(monkeypatch):
    # CAT + GS differentiates the clean logits twice: the clean forward keeps the model's own last layer, so the
    # counterfactual passes' first-token layer draws fresh dropout there (λ = 0 no longer gives ω = 1).
    model = tiny_model("bert", hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3, attn="eager").train()
    cat = CAT(model, layers=[1], adv_steps=0, generator=gen(), gs_weight=1.0)
    monkeypatch.setattr(cat, "_draw_lambda", lambda B, device, dtype: torch.zeros(B, device=device, dtype=dtype))
    assert models.first_token_ready(model, tiny_batch("bert"))  # the once-per-model check, before counting
    calls = _count_first_token_calls(monkeypatch)
    erm, cf, info = cat.losses(tiny_batch("bert"))
    assert calls == [True]  # the final counterfactual pass only
    assert float(info["crm_weight_mean"]) != 1.0
    cf.backward()  # the double backward of the GS term goes through the model's own attention


@pytest.mark.parametrize("arch", ["bert", "roberta", "electra", "distilbert"])
@pytest.mark.parametrize("detach_weight", [True, False])
def test_pruned_last_layer_gives_the_same_step(arch, detach_weight):
    # Eval mode, float64: loss, info and every parameter gradient equal with and without the first-token last
    # layer (padding rows, mixing at every layer below the last, CAL steps on).
    results = []
    for prune in (True, False):
        model = tiny_model(arch, dtype=torch.float64, num_layers=3).eval()
        cat = CAT(model, layers=[0, 1, 2], adv_steps=2, adv_lr=0.5, generator=gen(5), detach_weight=detach_weight,
                  mask_mode="union", prune_last_layer=prune)
        results.append(cat_steps(model, cat, arch))  # three draws of the layer
    assert_same_cat_steps(*results)


@pytest.mark.parametrize("arch", ["albert", "deberta-v2"])
def test_other_layer_layouts_run_the_full_last_layer(arch):
    model = tiny_model(arch).eval()
    cat = CAT(model, generator=gen())
    cat(tiny_batch(arch))
    assert not cat.first_token(models.capture(model, tiny_batch(arch), cat.layers[0]))


def test_warmup_is_plain_erm():
    model = tiny_model("bert").eval()
    batch = tiny_batch("bert")
    cat = CAT(model, warmup_steps=1, generator=gen())
    loss, info = cat(batch)
    want = F.cross_entropy(model(**models.model_inputs(batch)).logits, batch["labels"])
    torch.testing.assert_close(loss, want)
    assert float(info["cat_active"]) == 0.0
    loss2, info2 = cat(batch)
    assert float(info2["cat_active"]) == 1.0 and float(loss2.detach()) != float(loss.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lambda_is_the_beta_sample_of_torch_distributions(dtype):
    # Without a generator, λ is drawn as torch.distributions.Beta(α, β) draws it: the same values for a seed.
    cat = CAT(tiny_model("bert"), alpha=0.4, beta=0.7)
    for B in (5, 5, 3):  # the concentrations are kept per shape
        torch.manual_seed(B)
        got = cat._draw_lambda(B, torch.device("cpu"), dtype)
        torch.manual_seed(B)
        want = torch.distributions.Beta(torch.full((B,), 0.4, dtype=dtype), torch.full((B,), 0.7, dtype=dtype)).sample()
        assert got.dtype == dtype and torch.equal(got, want)


def test_generator_makes_steps_reproducible_and_seeds_matter():
    model = tiny_model("bert").eval()
    batch = tiny_batch("bert", batch=6)
    a, _ = CAT(model, generator=gen(1))(batch)
    b, _ = CAT(model, generator=gen(1))(batch)
    c, _ = CAT(model, generator=gen(2))(batch)
    torch.testing.assert_close(a, b)
    assert float(a.detach()) != float(c.detach())


@pytest.mark.parametrize("mask_mode", ["partner", "union", "intersection"])
def test_mask_modes_change_the_counterfactual(mask_mode):
    model = tiny_model("bert").eval()
    batch = tiny_batch("bert", batch=6)
    _, self_crm, _ = CAT(model, layers=[1], generator=gen(5)).losses(batch)
    _, other_crm, _ = CAT(model, layers=[1], mask_mode=mask_mode, generator=gen(5)).losses(batch)
    assert torch.isfinite(other_crm) and float(other_crm.detach()) != float(self_crm.detach())


def test_non_detached_weight_changes_the_gradient():
    batch = tiny_batch("bert")
    grads = []
    for detach in (True, False):
        model = tiny_model("bert").eval()
        loss, _ = CAT(model, detach_weight=detach, generator=gen()).__call__(batch)
        loss.backward()
        grads.append(model.bert.encoder.layer[0].attention.self.query.weight.grad.clone())
    assert (grads[0] - grads[1]).abs().max() > 1e-8


def test_alternate_update_steps_crm_then_returns_erm_on_updated_parameters():
    model = tiny_model("bert").eval()
    batch = tiny_batch("bert")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    w = model.classifier.weight
    w.grad = torch.full_like(w, 7.0)  # the caller's accumulated gradient must survive the inner CRM step
    before = w.detach().clone()
    cat = CAT(model, update="alternate", crm_optimizer=opt, generator=gen())
    loss, info = cat(batch)
    assert (w.detach() - before).abs().max() > 0  # the CRM update happened inside the call
    torch.testing.assert_close(w.grad, torch.full_like(w, 7.0))
    want = F.cross_entropy(model(**models.model_inputs(batch)).logits, batch["labels"])
    torch.testing.assert_close(loss, want)  # ERM of the updated model
    with pytest.raises(ValueError, match="crm_optimizer"):
        CAT(model, update="alternate")(batch)


def test_cat_plus_gs_adds_a_term_that_changes_the_gradient():
    batch = tiny_batch("bert", batch=6)
    batch["labels"] = torch.tensor([0, 1, 2, 0, 1, 2])
    grads = []
    for w in (0.0, 1.0):
        model = tiny_model("bert").eval()
        cat = CAT(model, layers=[1], gs_weight=w, generator=gen(4))
        loss, info = cat(batch)
        loss.backward()
        grads.append(model.bert.encoder.layer[2].output.dense.weight.grad.clone())
        if w:
            assert 0.0 < float(info["gs_loss"]) <= 2.0
            torch.testing.assert_close(loss.detach(), info["erm_loss"] + info["crm_loss"] + info["gs_loss"])
    assert (grads[0] - grads[1]).abs().max() > 1e-8


def qa_batch():
    # [CLS] q q [SEP] c c c c [SEP] pad ; answers inside the context
    ids = torch.randint(3, 100, (4, 10), generator=gen(9))
    types = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 0]] * 4)
    mask = torch.tensor([[1] * 9 + [0]] * 4)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types,
            "start_positions": torch.tensor([4, 5, 6, 0]), "end_positions": torch.tensor([5, 5, 7, 0])}


def test_qa_mixes_only_non_answer_context():
    model = tiny_model("bert", task="qa").eval()
    cat = CAT(model, layers=[2], generator=gen())
    batch = qa_batch()
    allow = cat._qa_allow(batch, (batch["start_positions"], batch["end_positions"]), 10, torch.device("cpu"))
    want = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 0],
                         [0, 0, 0, 0, 1, 0, 1, 1, 1, 0],
                         [0, 0, 0, 0, 1, 1, 0, 0, 1, 0],
                         [0, 0, 0, 0, 1, 1, 1, 1, 1, 0]], dtype=torch.float32)
    torch.testing.assert_close(allow, want)
    loss, info = cat(batch)
    assert torch.isfinite(loss) and set(info) == INFO_KEYS
    loss.backward()
    assert model.qa_outputs.weight.grad.abs().sum() > 0


def test_qa_context_from_separator_when_no_token_types():
    model = tiny_model("roberta", task="qa").eval()  # type_vocab_size=1: use </s> (eos id 2)
    cat = CAT(model, layers=[2], generator=gen())
    ids = torch.tensor([[1, 7, 8, 2, 2, 9, 10, 11, 2, 0]])
    batch = {"input_ids": ids, "attention_mask": (ids != 0).long(),
             "start_positions": torch.tensor([6]), "end_positions": torch.tensor([6])}
    allow = cat._qa_allow(batch, (batch["start_positions"], batch["end_positions"]), 10, torch.device("cpu"))
    torch.testing.assert_close(allow, torch.tensor([[0, 0, 0, 0, 0, 1, 0, 1, 0, 0]], dtype=torch.float32))


def test_invalid_arguments_are_refused():
    model = tiny_model("bert")
    with pytest.raises(ValueError, match="mask_mode"):
        CAT(model, mask_mode="both")
    with pytest.raises(ValueError, match="layers"):
        CAT(model, layers=[7])
    with pytest.raises(ValueError, match="gs_weight"):
        CAT(tiny_model("bert", task="qa"), gs_weight=1.0)


@pytest.mark.parametrize("kwargs, message", [
    ({"alpha": -5}, r"alpha: expected a finite number in \(0, inf\)"),
    ({"gamma": float("inf")}, "gamma: expected a finite number"),
    ({"adv_lr": float("nan")}, "adv_lr: expected a finite number"),
    ({"adv_steps": 1.5}, "adv_steps: expected an integer"),
    ({"a1": float("nan")}, "a1: expected a number"),
    ({"layers": [99]}, r"layers: expected mixing layers within \[0, 3\]"),
])
def test_bad_hyper_parameters_name_the_argument(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        CAT(tiny_model("bert"), **kwargs)
