"""Packed rows through `models.capture` at a layer and `models.resume` with the training layers
(`layers.training.PACKED`): the rows stay packed from layer to layer around the capture's own hooks, h_m is their
unpacked form, a resumed pass packs as the clean forward did (the same dropout draws), and first-order gradient
supervision at the embedding output runs packed with the values and gradients of the padded path."""
import math

import pytest
import torch
import torch.nn.functional as F

from cat_fast import models
from cat_fast.layers import training as training_layer
from cat_fast.objectives import CAT, ERM, GradientSupervision
from tests.conftest import tiny_batch, tiny_model

PAIRS = torch.tensor([1, 0, 3, 2])


def _batch():
    batch = tiny_batch("bert", batch=4, length=12)
    batch["attention_mask"] = (torch.arange(12) < torch.tensor([12, 5, 8, 3])[:, None]).long()
    batch["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 0)
    batch["labels"] = torch.tensor([0, 1, 2, 0])
    return batch


def _model(train=False, dropout=0.0, layers=5):
    model = tiny_model("bert", attn="sdpa", dtype=torch.float64, num_layers=layers, hidden_dropout_prob=dropout,
                       attention_probs_dropout_prob=dropout)
    return model.train(train)


def _params(model):
    return [p for p in model.parameters() if p.requires_grad]


def _capture_and_resume(model, batch, m, seed=3):
    """h_m, the clean logits, the resumed logits on ``h_m + δ`` and the gradients of both passes' losses w.r.t. the
    embeddings' output, δ and every parameter."""
    torch.manual_seed(seed)
    cap = models.capture(model, batch, m, training_layers=True)
    delta = (0.1 * torch.randn_like(cap.hidden)).requires_grad_(True)
    resumed = models.logits_of(models.resume(model, cap, cap.hidden + delta, training_layers=True))
    clean = models.logits_of(cap.outputs)
    loss = F.cross_entropy(clean, batch["labels"]) + F.cross_entropy(resumed, batch["labels"].flip(0))
    grads = torch.autograd.grad(loss, [cap.embedding_output, delta, *_params(model)], allow_unused=True)
    return cap.hidden.detach(), clean.detach(), resumed.detach(), grads


@pytest.mark.parametrize("m", [0, 2, 3])
def test_capture_at_a_layer_and_resume_packed_equal_padded(m, monkeypatch, pack_calls):
    """Eval mode, five layers (the last one a training layer too): h_m, the clean and resumed logits, and the
    gradients w.r.t. the embeddings' output, the edit and every parameter equal the padded path's in float64. The
    rows are packed at the first layer and handed on up to the last two layers, which pack their own; the capture
    unpacks h_m where it is packed (m > 0), and layer m+1 packs it again; the resumed pass packs at layer m+1."""
    model = _model()
    batch = _batch()
    _capture_and_resume(model, batch, m)  # the layers' output format recorded
    results = {}
    for packed in (False, True):
        monkeypatch.setattr(training_layer, "PACKED", packed)
        pack_calls.clear()
        results[packed] = _capture_and_resume(model, batch, m)
        if packed:
            clean = ["pack", "unpack"] * (2 if m == 0 else 3)
            resumed = ["pack", "unpack"] * 2
            assert pack_calls == clean + resumed
    real = batch["attention_mask"].bool()
    # h_m's padding rows: the first packed layer's input rows (the embeddings' output) in the packed path
    torch.testing.assert_close(results[True][0][real], results[False][0][real], rtol=1e-12, atol=1e-12)
    for a, b in zip(results[True][1:3], results[False][1:3]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(results[True][3], results[False][3]):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("m", [0, 2])
def test_a_packed_resume_redraws_the_clean_forwards_dropout(m, monkeypatch):
    """Train mode with dropout: resuming the packed clean forward on h_m itself gives its logits exactly (the packed
    layers draw the same masks over the same rows); the padded path's clean logits differ (other draws)."""
    model = _model(train=True, dropout=0.3)
    batch = _batch()
    models.capture(model, batch, m, training_layers=True)  # the layers' output format recorded
    logits = {}
    for packed in (False, True):
        monkeypatch.setattr(training_layer, "PACKED", packed)
        torch.manual_seed(11)
        cap = models.capture(model, batch, m, training_layers=True)
        resumed = models.resume(model, cap, cap.hidden.detach(), training_layers=True)
        torch.testing.assert_close(models.logits_of(resumed), models.logits_of(cap.outputs), rtol=0, atol=0)
        logits[packed] = models.logits_of(cap.outputs)
    assert not torch.equal(logits[True], logits[False])


@pytest.mark.parametrize("grad", [True, False], ids=["cal_step", "no_grad"])
def test_an_input_gradient_only_resume_of_a_packed_capture_redraws_its_dropout(grad, monkeypatch, pack_calls):
    """``resume(..., input_grad_only=True)`` (CAT's counterfactual passes) of a packed clean forward runs the training
    layers packed, with autograd (the input gradient only) and without: the clean forward's dropout masks, so
    resuming on h_m gives its logits exactly; the input gradient equals the one through the training layers."""
    model = _model(train=True, dropout=0.3)
    batch = _batch()
    models.capture(model, batch, 2, training_layers=True)
    monkeypatch.setattr(training_layer, "PACKED", True)
    torch.manual_seed(11)
    cap = models.capture(model, batch, 2, training_layers=True)
    pack_calls.clear()
    h = cap.hidden.detach().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out = models.logits_of(models.resume(model, cap, h, input_grad_only=True))
    assert pack_calls == ["pack", "unpack"] * 2
    torch.testing.assert_close(out, models.logits_of(cap.outputs), rtol=0, atol=0)
    if grad:
        (g,) = torch.autograd.grad(out[:, 1].sum(), h)
        want = models.logits_of(models.resume(model, cap, h, training_layers=True))
        (g_want,) = torch.autograd.grad(want[:, 1].sum(), h)
        torch.testing.assert_close(g, g_want, rtol=1e-12, atol=1e-12)
        assert all(p.grad is None for p in model.parameters())


def test_a_hook_of_the_users_keeps_the_capture_unpacked(monkeypatch, pack_calls):
    """A forward hook the user put on a layer could read its output: the capture's layers each pack and unpack."""
    model = _model()
    batch = _batch()
    models.capture(model, batch, 0, training_layers=True)
    seen = []
    models.structure(model).layer_modules[1].register_forward_hook(
        lambda mod, args, out: seen.append((out[0] if isinstance(out, tuple) else out).shape))
    monkeypatch.setattr(training_layer, "PACKED", True)
    models.capture(model, batch, 0, training_layers=True)
    assert pack_calls == ["pack", "unpack"] * 5 and seen == [torch.Size([4, 12, 32])]


def _gs_grads(model, batch, representation=0, low_memory=False, **kw):
    torch.manual_seed(5)
    loss, info = GradientSupervision(model, weight=2.0, representation=representation, mode="first_order",
                                     low_memory=low_memory, **kw)(batch, PAIRS)
    for p in model.parameters():
        p.grad = None
    loss.backward()  # the low-memory passes run inside it, writing .grad
    grads = [p.grad for p in _params(model)]
    for p in model.parameters():
        p.grad = None
    return loss.detach(), info["gs_loss"], grads


@pytest.mark.parametrize("representation", [0, "pooled"])
@pytest.mark.parametrize("low_memory", [False, True], ids=["graphs", "low_memory"])
@pytest.mark.parametrize("difference", ["forward", "central"])
def test_first_order_gs_packed_equals_padded(difference, low_memory, representation, monkeypatch, pack_calls):
    """First-order GS: with the rows packed (the clean forward and each perturbed pass packed once and unpacked once,
    with ``low_memory`` inside the backward) the loss, the GS term and every parameter gradient are the padded
    path's in float64."""
    model = _model()
    batch = _batch()
    kw = dict(difference=difference, low_memory=low_memory, representation=representation)
    _gs_grads(model, batch, **kw)
    results = {}
    for packed in (False, True):
        monkeypatch.setattr(training_layer, "PACKED", packed)
        pack_calls.clear()
        results[packed] = _gs_grads(model, batch, **kw)
        passes = 0 if representation == "pooled" else 1 + (2 if difference == "central" else 1)
        assert pack_calls == (["pack", "unpack"] * max(passes, 1) if packed else [])
    (loss, gs, grads), (want_loss, want_gs, want) = results[True], results[False]
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gs, want_gs, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_which_gs_and_cat_steps_pack_by_default():
    """`packs_rows` (a captured step packs by default): with the training layers, GS on the pooled vector and
    first-order GS at the embedding output; not GS at a layer above it (its loss reads the padding rows of h_K), not
    exact GS at a layer (the model's own layers, double backward), not CAT (CMIX reads a shorter partner's padding
    rows of h_m)."""
    model = _model()
    gs = GradientSupervision
    assert gs(model).packs_rows
    for representation in (0, "pooled"):
        assert gs(model, representation=representation, mode="first_order", low_memory=False).packs_rows
    assert not gs(model, representation=2, mode="first_order", low_memory=False).packs_rows
    assert not gs(model, training_layers=False).packs_rows
    assert not gs(model, representation=0).packs_rows
    assert ERM(model, fast=True).packs_rows and not CAT(model).packs_rows


def _cat_grads(model, batch, **kw):
    cat = CAT(model, layers=[2], adv_steps=2, generator=torch.Generator().manual_seed(0), **kw)
    torch.manual_seed(5)
    loss, info = cat(batch)
    grads = torch.autograd.grad(loss, _params(model), allow_unused=True)
    return loss.detach(), info["crm_loss"], info["lambda_after"], grads


def test_objectives_that_do_not_pack_run_padded_whatever_packed_says(monkeypatch, pack_calls):
    """With ``PACKED = True``, an objective without `packs_rows` packs nothing in its step: CAT, whose CMIX reads
    the padding rows of a shorter partner's h_m (which the packed path leaves as the embeddings' rows); its loss and
    gradients are those of ``PACKED = False``."""
    model = _model(train=True, dropout=0.2)
    batch = _batch()
    _cat_grads(model, batch)
    monkeypatch.setattr(training_layer, "PACKED", True)
    pack_calls.clear()
    loss, crm, lam, grads = _cat_grads(model, batch)
    assert pack_calls == []
    monkeypatch.setattr(training_layer, "PACKED", False)
    want_loss, want_crm, want_lam, want = _cat_grads(model, batch)
    assert torch.equal(loss, want_loss) and torch.equal(crm, want_crm) and torch.equal(lam, want_lam)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads, want))


def _gpu_gs_step(packed, train, autocast, monkeypatch, difference="central", representation=0):
    """Losses, the weights' updates, gradient norms and packed graphs of captured first-order GS steps on a tiny
    BERT (CUDA), with `PACKED` as given ("auto" packs from any row count here). The two batch shapes alternate with
    two real-token counts, so one shape has two packed graphs."""
    from cat_fast.step import CapturedStep

    monkeypatch.setattr(training_layer, "PACKED", packed)
    monkeypatch.setattr(training_layer, "PACKED_MIN_ROWS", 0)
    dropout = 0.1 if train else 0.0
    model = tiny_model("bert", attn="sdpa", num_layers=4, hidden_size=64, num_attention_heads=4,
                       intermediate_size=256, seed=0, hidden_dropout_prob=dropout,
                       attention_probs_dropout_prob=dropout).cuda().train(train)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # AdamW would turn gradients ~0 plus noise into lr-sized steps
    gs = GradientSupervision(model, weight=1.0, representation=representation, mode="first_order", low_memory=False,
                             difference=difference, eps=1e-2)
    step = CapturedStep(gs, opt, warmup_steps=1, autocast=autocast, max_grad_norm=1e6)
    lengths = [[40, 17, 25, 9], [33, 12, 20, 21]]
    losses, norms = [], []
    for i in range(8):
        batch = tiny_batch("bert", batch=4, length=40, seed=i % 2)
        batch["attention_mask"] = (torch.arange(40) < torch.tensor(lengths[i % 2])[:, None]).long()
        batch["labels"] = torch.tensor([0, 1, 2, 0])
        batch = {k: v.cuda() for k, v in batch.items()}
        losses.append(float(step(batch, PAIRS.cuda())[0]))
        norms.append(float(step.last_grad_norm))
    updates = {n: p.detach() - start[n] for n, p in model.named_parameters()}
    return losses, updates, norms, len(step._packed_graphs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_captured_first_order_gs_packed_equals_padded(autocast, monkeypatch):
    """`CapturedStep` of first-order GS at the embedding output (``packs_rows``: "auto" packs it): the clean forward
    and both perturbed passes on the graph's packed rows (bf16: variable-length attention). Without dropout, the
    losses and the weights' updates of the padded captured step through 8 SGD steps: in fp32 each to its rounding;
    in bf16, where the finite difference divides the two paths' roundings by its step of 0.1 (central differences
    at 16-bit precision are 10 % from the exact term, docs/METHODS.md §2.3), the losses to bf16 rounding and the
    whole update within 15 % of the padded one's norm (5.1 % measured on an H200)."""
    (losses, updates, _, graphs), (want_losses, want_updates, _, want_graphs) = (
        _gpu_gs_step(packed, False, autocast, monkeypatch) for packed in ("auto", False))
    assert graphs == 2 and want_graphs == 0
    if autocast is None:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-4, atol=1e-5)
        for name, a in updates.items():
            torch.testing.assert_close(a, want_updates[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        return
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=3e-2, atol=3e-3)
    a, b = (torch.cat([u.flatten() for u in d.values()]) for d in (updates, want_updates))
    assert (a - b).norm() <= 0.15 * b.norm(), float((a - b).norm() / b.norm())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("representation", [0, "pooled"])
@pytest.mark.parametrize("difference", ["forward", "central"])
def test_gpu_captured_packed_gs_passes_redraw_the_clean_dropout(difference, representation, monkeypatch):
    """Train mode with dropout: inside the packed graphs the perturbed passes redraw the clean forward's masks (their
    generators set at the marker from the offset measured on the packed signature's own eager warm-up steps, one per
    packed row count: `models.PassGenerators`). Masks drawn anew would put an O(1) logit change over a step of 1e-2,
    a gradient norm ~30× the padded step's (measured eagerly on the CPU); packed and padded gradient norms stay
    alike."""
    losses, _, norms, graphs = _gpu_gs_step("auto", True, None, monkeypatch, difference, representation)
    want_losses, _, want_norms, _ = _gpu_gs_step(False, True, None, monkeypatch, difference, representation)
    assert graphs == 2
    assert all(map(math.isfinite, losses + norms))
    ratio = torch.tensor(norms[2:]) / torch.tensor(want_norms[2:])
    assert ((ratio > 0.5) & (ratio < 2.0)).all(), (norms, want_norms)
