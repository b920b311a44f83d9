"""CUDA-graph replay of CAT's CAL loop (`cat_fast.objectives.cat_graphs`): the same step as the eager loop."""
import copy
import warnings

import pytest
import torch

import cat_fast
from cat_fast import CAT
from tests.conftest import TINY_ARCHS, tiny_batch, tiny_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _steps(model, batches, graph, seed=7, steps=3, autocast=None, wrap_forward=False, **kw):
    """`steps` CAT training steps (SGD) of `model` on `batches` (cycled); losses, infos, final parameters.
    ``wrap_forward``: ``model.forward`` runs inside its own bf16 autocast with the weight cache on, as accelerate
    wraps it for the Trainer under bf16."""
    if wrap_forward:
        model.forward = torch.autocast("cuda", dtype=torch.bfloat16)(model.forward)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)
    cat = CAT(model, generator=torch.Generator().manual_seed(seed), cuda_graph=graph, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, infos = [], []
    for i in range(steps):
        batch = batches[i % len(batches)]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast is not None):
            loss, info = cat(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        infos.append({k: v.detach().clone() for k, v in info.items()})
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return torch.stack(losses), infos, params, cat


def _compare(arch, train, task="cls", batches=None, autocast=None, tol=1e-6, attn="sdpa", captured=True, **kw):
    model = tiny_model(arch, task=task, num_layers=4, attn=attn).cuda().train(train)
    if batches is None:
        batches = [tiny_batch(arch, batch=6, length=11, num_labels=2 if task == "qa" else 3, seed=s) for s in (1, 2)]
        if task == "qa":
            for b in batches:
                labels = b.pop("labels")
                b["start_positions"], b["end_positions"] = labels + 4, labels + 6
                b["token_type_ids"] = (torch.arange(11) >= 3).long().expand(6, 11).clone()
        batches = [{k: v.cuda() for k, v in b.items()} for b in batches]
    eager = _steps(copy.deepcopy(model), batches, graph=False, autocast=autocast, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = _steps(copy.deepcopy(model), batches, graph=True, autocast=autocast, **kw)
    assert eager[3].graphs.num_graphs == 0
    if captured:
        assert graph[3].graphs.num_graphs >= 1, [str(w.message) for w in caught]  # the graph path ran
    else:  # capture refused: one warning, eager steps
        assert graph[3].graphs.num_graphs == 0
        assert any("CUDA-graph capture of the CAL loop failed" in str(w.message) for w in caught)
    torch.testing.assert_close(graph[0], eager[0], rtol=tol, atol=tol)
    for got, want in zip(graph[1], eager[1]):
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=tol, atol=tol, msg=key)
    torch.testing.assert_close(graph[2], eager[2], rtol=tol, atol=tol)
    return graph[3]


SDPA_ARCHS = [a for a in TINY_ARCHS if a != "deberta-v2"]  # DeBERTa-v2 has eager attention only


@cuda
@pytest.mark.parametrize("arch", SDPA_ARCHS)
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train-dropout"])
def test_graph_steps_match_eager_steps(arch, train):
    # 3 SGD steps, mixing layers drawn from {1, 2, 3}: captures, replays on updated weights, same dropout masks.
    _compare(arch, train, layers=[1, 2, 3])


@cuda
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train-dropout"])
def test_graphs_replayed_inside_the_clean_forward_match_eager_steps(train):
    # One mixing layer and one batch shape: from the second step on, the CAL graphs run from inside the clean
    # forward (as soon as h_m exists), before its layers m+1..L; the RNG state they use is restored for those.
    cat = _compare("bert", train, layers=[2], steps=4)
    assert cat.graphs.num_graphs == 1 and cat.graphs.replays_in_forward == 3


def _count_cal_ascent(monkeypatch):
    """Records, per call of `CAT.cal_ascent` (the one CAL step), whether it ran inside a CUDA-graph capture."""
    calls = []
    original = CAT.cal_ascent

    def counted(self, *args, **kwargs):
        calls.append(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CAT, "cal_ascent", counted)
    return calls


def test_the_eager_cal_loop_runs_the_one_cal_step(monkeypatch):
    calls = _count_cal_ascent(monkeypatch)
    model = tiny_model("bert").eval()
    cat = CAT(model, layers=[2], adv_steps=3, generator=torch.Generator().manual_seed(0))
    _, info = cat(tiny_batch("bert"))
    assert calls == [False] * 3
    assert not torch.equal(info["lambda_after"], info["lambda_before"])  # the steps moved λ


@cuda
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train-dropout"])
def test_the_cal_graph_replays_the_eager_cal_step_bit_for_bit(monkeypatch, train):
    # Four steps, one signature: the graph captures `CAT.cal_ascent` once (after one warm-up run) and replays it
    # adv_steps times a step, the final pass once a step; losses, infos and parameters equal the eager loop's.
    calls = _count_cal_ascent(monkeypatch)
    cat = _compare("bert", train, layers=[2], steps=4, tol=0)
    assert calls == [False] * (4 * cat.adv_steps) + [False, True]  # the eager run's steps, the warm-up, the capture
    (entry,) = [e for e in cat.graphs.cache.entries.values() if e is not None]
    assert entry.replays == {"cal": 4 * cat.adv_steps, "final": 4}


@cuda
def test_models_that_cannot_be_captured_run_eagerly_with_a_warning():
    # DeBERTa-v2 scripts its relative-position code, which capture refuses: CAT falls back to the eager loop, same
    # steps.
    _compare("deberta-v2", True, layers=[1, 2, 3], attn="eager", captured=False)


@cuda
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train-dropout"])
def test_eager_attention_is_captured(train):
    # Eager attention's mask is built with a host-to-device copy, which capture refuses: models.capture_safe_masks
    # builds the same mask on the device while CAT captures.
    _compare("bert", train, layers=[1, 2, 3], attn="eager", captured=True)


@cuda
@pytest.mark.parametrize("mask_mode", ["self", "union", "partner"])
def test_graph_steps_match_with_mask_modes_and_padding(mask_mode):
    _compare("bert", True, layers=[2], mask_mode=mask_mode)


@cuda
def test_graph_steps_match_for_question_answering():
    _compare("bert", True, task="qa", layers=[2, 3])


@cuda
def test_graph_steps_match_at_the_last_layer_and_under_bf16_autocast():
    _compare("bert", True, layers=[4])
    _compare("roberta", True, layers=[2, 3], autocast=torch.bfloat16, tol=1e-5)


@cuda
def test_a_forward_wrapped_in_autocast_replays_the_eager_steps():
    # The forward's own autocast turns the weight cache on inside the capture: without emptying it around the capture
    # (models.graph_capture) the replays read the freed bf16 weight copies of an earlier clean forward (NaN λ).
    _compare("bert", True, autocast=torch.bfloat16, tol=1e-5, layers=[2], steps=5, wrap_forward=True)


@cuda
def test_graph_cat_star_and_partner_with_replacement():
    _compare("bert", True, layers=[2], adv_steps=0)
    _compare("bert", True, layers=[2], partner="replacement")


@cuda
def test_one_graph_pair_per_signature_and_the_limit():
    cat = _compare("bert", False, layers=[2])
    assert cat.graphs.num_graphs == 1  # two batches of one shape, one layer
    model = tiny_model("bert", num_layers=4, attn="sdpa").cuda()
    batches = [{k: v.cuda() for k, v in tiny_batch("bert", batch=6, length=n).items()} for n in (9, 11, 13)]
    cat = CAT(model, layers=[2], max_graphs=2)
    with pytest.warns(RuntimeWarning, match="max_graphs=2"):
        for batch in batches:
            cat(batch)[0].backward()
    assert cat.graphs.num_graphs == 2


@cuda
@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "padded"])
def test_graph_step_has_no_host_sync(padded):
    # Padded: the model gets the 4-D SDPA mask (models.sync_free_inputs), so its mask code does not ask the GPU
    # whether the batch has padding.
    model = tiny_model("bert", num_layers=4, attn="sdpa").cuda().train()
    batch = {k: v.cuda() for k, v in tiny_batch("bert", batch=6, length=11, padded=padded).items()}
    if not padded:
        batch.pop("attention_mask")
    else:
        assert bool((batch["attention_mask"] == 0).any())
    cat = CAT(model, layers=[2])
    for _ in range(2):  # capture
        cat(batch)[0].backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, _ = cat(batch)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert cat.graphs.num_graphs == 1


def test_cuda_graph_is_not_used_off_cuda_and_max_graphs_is_checked():
    model = tiny_model("bert").eval()
    cat = CAT(model, layers=[2], generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cat(tiny_batch("bert"))
    assert cat.graphs.num_graphs == 0
    with pytest.raises(ValueError, match="max_graphs"):
        CAT(model, max_graphs=-1)
    with pytest.raises(ValueError, match="max_graphs"):
        CAT(model, max_graphs=1.5)
    assert cat_fast.CAT is CAT


@cuda
def test_replaced_parameters_drop_the_graphs():
    # Graphs read parameter addresses: a new head module must not be served by a graph captured on the old one.
    model = tiny_model("bert", num_layers=4, attn="sdpa").cuda().eval()
    batch = {k: v.cuda() for k, v in tiny_batch("bert", batch=6, length=11).items()}
    cat = CAT(model, layers=[2], generator=torch.Generator().manual_seed(0))
    cat(batch)
    assert cat.graphs.num_graphs == 1
    torch.manual_seed(1)
    model.classifier = torch.nn.Linear(32, 3).cuda()
    twin = torch.Generator()
    twin.set_state(cat.generator.get_state())  # the same λ and partner draws for the eager twin
    eager = CAT(model, layers=[2], cuda_graph=False, generator=twin).losses(batch)
    graph = cat.losses(batch)
    assert cat.graphs.num_graphs == 1  # the old pair dropped, a new one captured on the new head
    for key in ("crm_loss", "lambda_after", "cal_objective"):
        torch.testing.assert_close(graph[2][key], eager[2][key], rtol=1e-6, atol=1e-6, msg=key)


@cuda
@pytest.mark.parametrize("autocast,tol", [(None, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16-autocast"])
def test_pruned_last_layer_gives_the_full_layer_step_on_cuda(autocast, tol):
    # Graph path, eval mode (no dropout): the first-token last layer changes no value beyond rounding.
    model = tiny_model("bert", num_layers=4, attn="sdpa").cuda().eval()
    batches = [{k: v.cuda() for k, v in tiny_batch("bert", batch=6, length=11, seed=s).items()} for s in (1, 2)]
    pruned = _steps(copy.deepcopy(model), batches, graph=True, autocast=autocast, layers=[1, 2, 3])
    full = _steps(copy.deepcopy(model), batches, graph=True, autocast=autocast, layers=[1, 2, 3],
                  prune_last_layer=False)
    assert pruned[3].first_token(cat_fast.models.capture(model, batches[0], 2))
    torch.testing.assert_close(pruned[0], full[0], rtol=tol, atol=tol)
    for got, want in zip(pruned[1], full[1]):
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=tol, atol=tol, msg=key)
    torch.testing.assert_close(pruned[2], full[2], rtol=tol, atol=tol)


def test_weight_addresses_follow_replaced_tensors_without_walking_the_model_each_step():
    # The graphs' invalidation key (no CUDA needed): a new head module, a parameter's storage swapped, a buffer
    # reassigned each change it; an in-place update does not; an unchanged model is not walked again.
    model = tiny_model("bert").eval()
    graphs = CAT(model).graphs
    first = graphs._weights()
    assert graphs._weights() == first and graphs._tensors_at is not None
    listed = graphs._tensors
    assert graphs._weights() == first and graphs._tensors is listed  # no new walk of the model
    with torch.no_grad():
        model.classifier.weight.add_(1.0)
    assert graphs._weights() == first
    model.classifier = torch.nn.Linear(32, 3)
    second = graphs._weights()
    assert second != first
    model.classifier.weight.data = torch.zeros(3, 32)
    third = graphs._weights()
    assert third != second
    name = next(n for n, _ in model.bert.embeddings.named_buffers())
    setattr(model.bert.embeddings, name, getattr(model.bert.embeddings, name).clone())
    assert graphs._weights() != third
