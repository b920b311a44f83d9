"""benchmarks/steps/harness.py: every method of the step suite builds from the objective registry and runs a step on
the tiny CPU model (the suite's own cases skip on a CPU without CAT_FAST_BENCH_STEP_CPU=1)."""
import pytest
import torch

from benchmarks.steps import harness as S
from benchmarks.steps.flops import flop_fields, model_flops

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the tiny CPU model is built only without CUDA")

EAGER = [m for m in S.METHODS if m not in S.COMPILED_METHODS]
# One method of each way a step is built: hand-written, naive CAT, CAT (drawn layer), pairs (GS), a bias model with
# trainable tensors, a metadata set (CLP), and CapturedStep with and without per-layer graphs.
STEPPED = ("plain_training_layers", "naive_cat", "cat", "gs_first_order_fwd", "learned_mixin", "clp", "cat_captured",
           "poe_captured")


def test_every_method_builds_from_the_registry():
    for method in EAGER:
        _, optimizer, step = S.build_step(method, "2x16")
        spec = S.SPECS[method]
        assert hasattr(step, "captured") == (spec.captured is not None), method
        if spec.objective is not None:
            assert type(step.objective).__module__.startswith("cat_fast.objectives"), method
        if method == "learned_mixin":  # its gate joins the optimizer
            assert len(optimizer.param_groups) == 2


@pytest.mark.parametrize("method", STEPPED)
def test_a_step_trains_the_model(method):
    torch.manual_seed(0)
    model, _, step = S.build_step(method, "2x16")
    before = [p.detach().clone() for p in model.parameters()]
    step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    if S.SPECS[method].per_layer:
        assert len(step.layers) == 1 and step.layers[0] in S.LAYERS


def test_layers_override_the_suite_mixing_layers():
    _, _, step = S.build_step("cat", "2x16", layers=[S.LAYERS[-1]])
    step()
    assert step.layers == [S.LAYERS[-1]] and step.objective.layers == [S.LAYERS[-1]]


def test_flops_follow_the_method_spec():
    config = S.make_config("sdpa")
    plain = model_flops(config, 2, 16, "plain")
    forward_cut = model_flops(config, 2, 16, "plain_first_token") / 3
    assert model_flops(config, 2, 16, "gs_first_order") == pytest.approx(3 * forward_cut + forward_cut + 6 * forward_cut)
    assert model_flops(config, 2, 16, "gs_first_order_fwd_captured") == model_flops(config, 2, 16, "gs_first_order_fwd")
    assert model_flops(config, 2, 16, "clp") == 4 * plain / 3
    assert flop_fields(config, 2, 16, "gs_exact", 1, 1.0) == {}
    fields = flop_fields(config, 2, 16, "cat", 2, 1.0)
    assert fields["flops_plain"] == plain and fields["flop_ratio_final_backward"] > fields["flop_ratio"] > 1
