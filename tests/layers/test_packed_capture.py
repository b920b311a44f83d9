"""Packed rows through `models.capture` at a layer and `models.resume` with the training layers
(`layers.training.PACKED`): the rows stay packed from layer to layer around the capture's own hooks, h_m is their
unpacked form, a resumed pass packs as the clean forward did (the same dropout draws), and first-order gradient
supervision at the embedding output runs packed with the values and gradients of the padded path."""
import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from cat_fast import models
from cat_fast.layers import packing
from cat_fast.layers import training as training_layer
from cat_fast.objectives import CAT, ERM, GradientSupervision
from tests.conftest import tiny_batch, tiny_model

PAIRS = torch.tensor([1, 0, 3, 2])


def _batch(length=12):
    batch = tiny_batch("bert", batch=4, length=length)
    batch["attention_mask"] = (torch.arange(length) < torch.tensor([12, 5, 8, 3])[:, None]).long()
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
    rows are packed at the first layer and handed on up to the last layer, which unpacks its output; the capture
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
            clean = ["pack", "unpack"] * (1 if m == 0 else 2)
            resumed = ["pack", "unpack"]
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


@pytest.mark.parametrize("packed", [False, True])
def test_a_models_first_training_forward_draws_what_later_ones_draw(packed, monkeypatch):
    """The first training forward of a model runs its own layer once for the output format with its random draws
    undone, then the training layers: from one seed, the first forward's logits and dropout masks are every later
    forward's (`models.PassGenerators` measures a step's draws on eager steps, the first one included)."""
    monkeypatch.setattr(training_layer, "PACKED", packed)
    model = _model(train=True, dropout=0.3)
    batch = _batch()
    logits = []
    for _ in range(2):
        torch.manual_seed(11)
        logits.append(models.logits_of(models.capture(model, batch, 2, training_layers=True).outputs))
        logits.append(torch.rand(()))  # where the generator stands after the forward
    assert torch.equal(logits[0], logits[2]) and torch.equal(logits[1], logits[3])


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
    assert pack_calls == ["pack", "unpack"]  # packed at layer 3, unpacked by the last layer
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
    """First-order GS: with the rows packed (the clean forward and each perturbed pass packed once, the clean forward
    unpacked once; with ``low_memory`` inside the backward) the loss, the GS term and every parameter gradient are the padded
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
        perturbed = 0 if representation == "pooled" else (2 if difference == "central" else 1)
        # the clean forward unpacks its last layer's whole output; a perturbed pass's first-token last layer hands
        # the head its row 0 from the packed rows
        assert pack_calls == (["pack", "unpack"] + ["pack"] * perturbed if packed else [])
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
    exact GS at a layer (the model's own layers, double backward); CAT without GS (it packs the padding rows CMIX
    reads too, `CAT.packed_rows`)."""
    model = _model()
    gs = GradientSupervision
    assert gs(model).packs_rows
    for representation in (0, "pooled"):
        assert gs(model, representation=representation, mode="first_order", low_memory=False).packs_rows
    assert not gs(model, representation=2, mode="first_order", low_memory=False).packs_rows
    assert not gs(model, training_layers=False).packs_rows
    assert not gs(model, representation=0).packs_rows
    assert ERM(model, fast=True).packs_rows and CAT(model).packs_rows
    assert not CAT(model, gs_weight=1.0).packs_rows


def _cat_grads(model, batch, **kw):
    cat = CAT(model, layers=[2], adv_steps=2, generator=torch.Generator().manual_seed(0), **kw)
    torch.manual_seed(5)
    loss, info = cat(batch)
    grads = torch.autograd.grad(loss, _params(model), allow_unused=True)
    return loss.detach(), info["crm_loss"], info["lambda_after"], grads


def _assert_same_cat(got, want, exact=False):
    check = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-10, atol=1e-12))
    (loss, crm, lam, grads), (want_loss, want_crm, want_lam, want_grads) = got, want
    assert check(loss, want_loss) and check(crm, want_crm) and check(lam, want_lam), (loss, want_loss, lam, want_lam)
    for a, b in zip(grads, want_grads):
        assert (a is None and b is None) or check(a, b)


def test_cat_packed_rows_hold_every_row_cmix_reads():
    """`CAT.packed_rows`: a sample's real tokens, the positions its mixed sequence keeps and those of each mixed
    sequence it is the partner of, per `mask_mode`."""
    model = _model()
    mask = _batch()["attention_mask"]  # lengths 12, 5, 8, 3
    partner = torch.tensor([3, 2, 0, 1])
    lengths = {"self": [12, 5, 8, 12], "partner": [12, 8, 12, 5], "union": [12, 8, 12, 12],
               "intersection": [12, 5, 8, 3]}
    for mode, want in lengths.items():
        rows = CAT(model, mask_mode=mode).packed_rows({"attention_mask": mask}, {"partner": partner})
        assert torch.equal(rows, torch.arange(12) < torch.tensor(want)[:, None]), mode
    assert CAT(model).packed_rows({"input_ids": mask}, {"partner": partner}) is None


@pytest.mark.parametrize("mask_mode", ["self", "partner", "union", "intersection"])
@pytest.mark.parametrize("partner", ["permutation", "replacement"])
def test_cat_packed_equals_padded(mask_mode, partner, monkeypatch, pack_calls):
    """With ``PACKED = True`` CAT packs its rows, the padding rows CMIX reads included (a partner shorter than its
    sample), in the clean forward and every counterfactual pass: its loss, CRM term, optimised λ and every
    parameter's gradient equal the padded step's in float64, under every mask mode and both partner draws."""
    model = _model(train=True)
    batch = _batch()
    kw = dict(mask_mode=mask_mode, partner=partner, cuda_graph=False)
    monkeypatch.setattr(training_layer, "PACKED", False)
    want = _cat_grads(model, batch, **kw)
    assert pack_calls == []
    monkeypatch.setattr(training_layer, "PACKED", True)
    got = _cat_grads(model, batch, **kw)
    # the clean forward packs twice (its first layer, and layer 3 after the capture's unpacked h_m); each of the 3
    # passes once (layer 3, carried to layer 4)
    assert pack_calls.count("pack") == 2 + 3
    _assert_same_cat(got, want)


def test_cat_packed_equals_padded_with_a_differentiable_weight(monkeypatch):
    """``detach_weight=False``: the final counterfactual pass is differentiated into h_m, the partners' padding rows
    included, and through them into the clean forward; packed, every gradient is the padded step's."""
    model = _model(train=True)
    batch = _batch()
    want = _cat_grads(model, batch, detach_weight=False, mask_mode="union", cuda_graph=False)
    monkeypatch.setattr(training_layer, "PACKED", True)
    _assert_same_cat(_cat_grads(model, batch, detach_weight=False, mask_mode="union", cuda_graph=False), want)


def test_cat_for_qa_runs_padded(monkeypatch, pack_calls):
    """CAT on a QA head does not pack (`packs_rows`): the span loss reads the logits of every position, padding
    included; with ``PACKED = True`` its step is the padded one."""
    model = tiny_model("bert", task="qa", attn="sdpa", dtype=torch.float64, num_layers=5, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0).train()
    mask = (torch.arange(12) < torch.tensor([12, 8, 10, 7])[:, None]).long()
    ids = torch.randint(3, 100, (4, 12), generator=torch.Generator().manual_seed(9)).masked_fill(mask == 0, 0)
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": (torch.arange(12) >= 4).long().expand(4, 12),
             "start_positions": torch.tensor([4, 5, 6, 0]), "end_positions": torch.tensor([5, 5, 7, 0])}
    assert not CAT(model).packs_rows
    want = _cat_grads(model, batch, cuda_graph=False)
    monkeypatch.setattr(training_layer, "PACKED", True)
    pack_calls.clear()
    got = _cat_grads(model, batch, cuda_graph=False)
    assert pack_calls == []
    _assert_same_cat(got, want, exact=True)


def test_cat_packed_without_the_partners_rows_differs(monkeypatch):
    """The check above can fail: packing only the real rows (a shorter partner's padding rows of h_m then left as
    the embeddings') moves CAT's loss away from the padded step's."""
    model = _model(train=True)
    batch = _batch()
    want = _cat_grads(model, batch, cuda_graph=False)
    monkeypatch.setattr(training_layer, "PACKED", True)
    monkeypatch.setattr(CAT, "packed_rows", lambda self, batch, tensors: batch["attention_mask"] != 0)
    got = _cat_grads(model, batch, cuda_graph=False)
    with pytest.raises(AssertionError):
        _assert_same_cat(got, want)


@pytest.mark.parametrize("lent", [True, False], ids=["apart", "packed"])
@pytest.mark.parametrize("mask_mode, narrowed", [("self", 28), ("union", 37)])
def test_cat_packs_fewer_rows_past_the_mixing_layer(mask_mode, narrowed, lent, monkeypatch):
    """The padding rows a partner lends to CMIX are computed up to h_m only: carried apart, forward only, beside the
    clean forward's real rows (28; `packing.lent`, the default), or with ``LENT = False`` packed with them from the
    first layer; then layer m+1 of the clean forward and of every pass packs the mixed sequences' rows (self: the
    real ones, 28; union: each sample's and its partner's, 37), and the step equals the padded one."""
    model = _model(train=True)
    batch = _batch(16)  # lengths 12, 5, 8, 3 of 16: padding enough for the union's 44 rows to pack
    monkeypatch.setattr(CAT, "_draw_partner", lambda self, B, device: torch.tensor([3, 2, 0, 1]))
    want = _cat_grads(model, batch, mask_mode=mask_mode, cuda_graph=False)
    monkeypatch.setattr(training_layer, "PACKED", True)
    monkeypatch.setattr(packing, "LENT", lent)
    counts, carried = [], []
    original, lent_forward = packing.pack, training_layer._lent_forward
    monkeypatch.setattr(packing, "pack", lambda hidden, plan: counts.append(plan.idx.numel()) or original(hidden, plan))
    monkeypatch.setattr(training_layer, "_lent_forward",
                        lambda state, *a: carried.append(state.idx.numel()) or lent_forward(state, *a))
    got = _cat_grads(model, batch, mask_mode=mask_mode, cuda_graph=False)
    extended = {"self": 12 + 5 + 8 + 12, "union": 12 + 8 + 12 + 12}[mask_mode]  # `test_cat_packed_rows_hold_...`
    # the clean forward, then its layer 3 and each of the three passes'
    assert counts == [28 if lent else extended] + [narrowed] * 4
    assert carried == ([extended - 28] * 2 if lent else [])  # the lent rows through layers 1 and 2
    _assert_same_cat(got, want)


def test_cat_lent_rows_left_uncarried_differ(monkeypatch):
    """The checks above can fail: lent rows not carried through the layers (left as the embeddings' rows) move
    CAT's step away from the padded one."""
    model = _model(train=True)
    batch = _batch(16)
    monkeypatch.setattr(CAT, "_draw_partner", lambda self, B, device: torch.tensor([3, 2, 0, 1]))
    want = _cat_grads(model, batch, cuda_graph=False)
    monkeypatch.setattr(training_layer, "PACKED", True)
    monkeypatch.setattr(training_layer, "_lent_forward", lambda *a: None)
    got = _cat_grads(model, batch, cuda_graph=False)
    with pytest.raises(AssertionError):
        _assert_same_cat(got, want)


def test_cat_lent_rows_under_a_static_count(monkeypatch):
    """Under a static count (`packing.static_rows((n, n_after, n_lent))`, as a captured step sets it) the lent rows
    are carried with spare rows after them, whose results go to a scratch row: the step equals the padded one. A
    count below the lent rows fails loudly (the device-side assertion)."""
    model = _model(train=True)
    batch = _batch(16)
    monkeypatch.setattr(CAT, "_draw_partner", lambda self, B, device: torch.tensor([3, 2, 0, 1]))
    want = _cat_grads(model, batch, cuda_graph=False)
    monkeypatch.setattr(training_layer, "PACKED", True)
    carried = []
    lent_forward = training_layer._lent_forward
    monkeypatch.setattr(training_layer, "_lent_forward",
                        lambda state, *a: carried.append(state.idx.numel()) or lent_forward(state, *a))
    with packing.static_rows((32, 32, 20)):  # 28 real rows, 9 lent
        got = _cat_grads(model, batch, cuda_graph=False)
    assert carried == [20, 20]
    _assert_same_cat(got, want)
    with packing.static_rows((32, 32, 8)), pytest.raises(RuntimeError):
        _cat_grads(model, batch, cuda_graph=False)


def test_cat_without_narrowing_packs_the_lent_rows_throughout(monkeypatch):
    """``packing.NARROW = False`` (for comparisons): every layer of every pass packs the extended rows, and the
    step still equals the padded one."""
    model = _model(train=True)
    batch = _batch(16)
    monkeypatch.setattr(CAT, "_draw_partner", lambda self, B, device: torch.tensor([3, 2, 0, 1]))
    want = _cat_grads(model, batch, cuda_graph=False)
    monkeypatch.setattr(training_layer, "PACKED", True)
    monkeypatch.setattr(packing, "NARROW", False)
    counts = []
    original = packing.pack
    monkeypatch.setattr(packing, "pack", lambda hidden, plan: counts.append(plan.idx.numel()) or original(hidden, plan))
    got = _cat_grads(model, batch, cuda_graph=False)
    assert counts == [37] * 5
    _assert_same_cat(got, want)


def test_cat_narrowed_before_the_mixing_layer_differs(monkeypatch):
    """The check above can fail: narrowing from the first layer (the lent padding rows of h_m then not computed)
    moves CAT's step away from the padded one."""
    model = _model(train=True)
    batch = _batch()
    monkeypatch.setattr(CAT, "_draw_partner", lambda self, B, device: torch.tensor([3, 2, 0, 1]))
    want = _cat_grads(model, batch, cuda_graph=False)
    monkeypatch.setattr(training_layer, "PACKED", True)
    monkeypatch.setattr(packing, "LENT", False)  # the lent rows packed with the real ones, up to the narrowing
    original = packing.extended

    @contextlib.contextmanager
    def early(rows, after=None):
        with original(rows, after=after):
            packing.narrow()
            yield

    monkeypatch.setattr(packing, "extended", early)
    got = _cat_grads(model, batch, cuda_graph=False)
    with pytest.raises(AssertionError):
        _assert_same_cat(got, want)


def test_cat_packed_with_dropout_draws_alike_in_its_passes(monkeypatch, pack_calls):
    """In train mode with dropout, a packed CAT step's counterfactual passes draw the clean forward's masks: at
    λ = 0 (α tiny, no CAL step) the counterfactual logits are the clean ones, so every CRM weight is 1."""
    model = _model(train=True, dropout=0.2)
    models.capture(model, _batch(), 2, training_layers=True)  # the layers' output format recorded
    monkeypatch.setattr(training_layer, "PACKED", True)
    cat = CAT(model, layers=[2], adv_steps=0, alpha=1e-6, beta=1e6, generator=torch.Generator().manual_seed(0),
              cuda_graph=False)
    loss, info = cat(_batch())
    assert pack_calls.count("pack") == 2 + 1  # the clean forward (twice, around h_m), then the pass
    torch.testing.assert_close(info["crm_weight_mean"], torch.ones((), dtype=torch.float64))


def test_objectives_that_do_not_pack_run_padded_whatever_packed_says(monkeypatch, pack_calls):
    """With ``PACKED = True``, an objective without `packs_rows` packs nothing in its step: CAT with GS (its double
    backward runs the model's own layers); its loss and gradients are those of ``PACKED = False``."""
    model = _model(train=True, dropout=0.2)
    batch = _batch()
    _cat_grads(model, batch, gs_weight=0.5)
    monkeypatch.setattr(training_layer, "PACKED", True)
    pack_calls.clear()
    got = _cat_grads(model, batch, gs_weight=0.5)
    assert pack_calls == []
    monkeypatch.setattr(training_layer, "PACKED", False)
    _assert_same_cat(got, _cat_grads(model, batch, gs_weight=0.5), exact=True)


def _gpu_model(packed, train, monkeypatch):
    """``(model, its starting weights, SGD)``: a tiny BERT on CUDA (dropout 0.1 in train mode), with `PACKED` as
    given ("auto" packs from any row count here). SGD: AdamW would turn gradients ~0 plus noise into lr-sized steps."""
    monkeypatch.setattr(training_layer, "PACKED", packed)
    monkeypatch.setattr(training_layer, "PACKED_MIN_ROWS", 0)
    dropout = 0.1 if train else 0.0
    model = tiny_model("bert", attn="sdpa", num_layers=4, hidden_size=64, num_attention_heads=4,
                       intermediate_size=256, seed=0, hidden_dropout_prob=dropout,
                       attention_probs_dropout_prob=dropout).cuda().train(train)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    return model, start, torch.optim.SGD(model.parameters(), lr=0.1)


def _gpu_batches():
    """8 CUDA batches, two shapes' real-token counts alternating."""
    lengths = [[40, 17, 25, 9], [33, 12, 20, 21]]
    for i in range(8):
        batch = tiny_batch("bert", batch=4, length=40, seed=i % 2)
        batch["attention_mask"] = (torch.arange(40) < torch.tensor(lengths[i % 2])[:, None]).long()
        batch["labels"] = torch.tensor([0, 1, 2, 0])
        yield {k: v.cuda() for k, v in batch.items()}


def _steps_given(step, host, before=None):
    """The losses of `step` over `_gpu_batches`, each batch given on the device or, with `host`, as pinned CPU
    tensors, with no host synchronisation allowed from the fifth step on (both signatures captured by then);
    ``before(i)`` runs before step i."""
    losses = []
    for i, batch in enumerate(_gpu_batches()):
        if before is not None:
            before(i)
        if host:
            batch = {k: v.cpu().pin_memory() for k, v in batch.items()}
        torch.cuda.set_sync_debug_mode("error" if host and i >= 4 else 0)
        try:
            losses.append(step(batch)[0])
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return losses


def _gpu_gs_step(packed, train, autocast, monkeypatch, difference="central", representation=0):
    """Losses, the weights' updates, gradient norms and packed graphs of captured first-order GS steps on a tiny
    BERT (CUDA), with `PACKED` as given ("auto" packs from any row count here). The two batch shapes alternate with
    two real-token counts, so one shape has two packed graphs."""
    from cat_fast.step import CapturedStep

    model, start, opt = _gpu_model(packed, train, monkeypatch)
    gs = GradientSupervision(model, weight=1.0, representation=representation, mode="first_order", low_memory=False,
                             difference=difference, eps=1e-2)
    step = CapturedStep(gs, opt, warmup_steps=1, autocast=autocast, max_grad_norm=1e6, share_rows=0)
    losses, norms = [], []
    for batch in _gpu_batches():
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
@pytest.mark.parametrize("train", [False, True])
def test_gpu_a_batch_given_on_the_host_steps_as_on_the_device_without_a_synchronisation(train, monkeypatch):
    """`CapturedStep` given each batch as pinned CPU tensors (as a ``DataLoader(pin_memory=True)`` yields them):
    the step moves it and reads the packed row count from its host mask, so a replayed packed step makes no host
    synchronisation (`set_sync_debug_mode("error")` raises on one: the device batch's count does), and its losses,
    packed graphs and weights are those of the same batches given on the device, bit for bit, dropout included."""
    from cat_fast.step import CapturedStep

    results = {}
    for host in (False, True):
        model, _, opt = _gpu_model("auto", train, monkeypatch)
        torch.cuda.manual_seed(0)
        step = CapturedStep(ERM(model, fast=True), opt, warmup_steps=1, share_rows=0)
        losses = _steps_given(step, host)
        results[host] = (losses, len(step._packed_graphs), step.num_replays,
                         [p.detach().clone() for p in model.parameters()])
        if not host:  # the device batch's count is read from the device
            torch.cuda.set_sync_debug_mode("error")
            try:
                with pytest.raises(RuntimeError, match="synchroniz"):
                    step(next(_gpu_batches()))
            finally:
                torch.cuda.set_sync_debug_mode(0)
    (losses, graphs, replays, weights), (want_losses, want_graphs, want_replays, want_weights) = (
        results[True], results[False])
    assert graphs == want_graphs == 2 and replays == want_replays >= 4
    assert all(torch.equal(a, b) for a, b in zip(losses, want_losses))
    assert all(torch.equal(a, b) for a, b in zip(weights, want_weights))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_gpu_captured_cat_counts_its_packed_rows_on_the_host(train, monkeypatch):
    """A captured packed CAT step given pinned CPU batches reads its row counts (the rows its partners lend, and
    the narrowed ones) from the host mask and the partners' host copy (`StepPlan.host`): its replays make no host
    synchronisation, and its losses and weights are those of the same batches given on the device, bit for bit."""
    from cat_fast.step import CapturedStep

    results = {}
    for host in (False, True):
        model, _, opt = _gpu_model(True, train, monkeypatch)
        torch.cuda.manual_seed(0)
        cat = CAT(model, layers=[2], adv_steps=2, generator=torch.Generator().manual_seed(0))
        step = CapturedStep(cat, opt, warmup_steps=1, share_rows=0)
        # the draws repeat with the batch shape: two signatures
        losses = _steps_given(step, host, before=lambda i: cat.generator.manual_seed(i % 2))
        results[host] = (losses, step._packed_graphs, step.num_replays, [p.detach().clone() for p in model.parameters()])
    (losses, graphs, replays, weights), (want_losses, want_graphs, want_replays, want_weights) = (
        results[True], results[False])
    assert len(graphs) == len(want_graphs) == 2 and replays == want_replays >= 4
    assert any("('rows', (" in repr(sig) for sig in graphs)  # the narrowed count too
    assert all(torch.equal(a, b) for a, b in zip(losses, want_losses))
    assert all(torch.equal(a, b) for a, b in zip(weights, want_weights))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("representation", [0, "pooled"])
@pytest.mark.parametrize("difference", ["forward", "central"])
def test_gpu_captured_packed_gs_passes_redraw_the_clean_dropout(difference, representation, monkeypatch):
    """Train mode with dropout: inside the packed graphs the perturbed passes redraw the clean forward's masks (their
    generators set at the marker from the offset measured for each packed row count: by the batch shape's eager
    warm-up step for the first count, by the capture for the second, `models.PassGenerators`). Masks drawn anew would put an O(1) logit change over a step of 1e-2,
    a gradient norm ~30× the padded step's (measured eagerly on the CPU); packed and padded gradient norms stay
    alike."""
    losses, _, norms, graphs = _gpu_gs_step("auto", True, None, monkeypatch, difference, representation)
    want_losses, _, want_norms, _ = _gpu_gs_step(False, True, None, monkeypatch, difference, representation)
    assert graphs == 2
    assert all(map(math.isfinite, losses + norms))
    ratio = torch.tensor(norms[2:]) / torch.tensor(want_norms[2:])
    assert ((ratio > 0.5) & (ratio < 2.0)).all(), (norms, want_norms)


def _gpu_cat_step(packed, train, autocast, monkeypatch, mask_mode="self", share_rows=0.0, **cat_kw):
    """Losses, CRM weights, the weights' updates and packed graphs of captured CAT steps on a tiny BERT (CUDA), with
    `PACKED` as given; partners and λ from a seeded CPU generator, so both runs draw alike. Two batch shapes of
    different real-token counts alternate (each count its own graph, unless `share_rows`)."""
    from cat_fast.step import CapturedStep

    model, start, opt = _gpu_model(packed, train, monkeypatch)
    model.train(True)
    cat_kw = {"adv_steps": 3, **cat_kw}
    cat = CAT(model, layers=[2], mask_mode=mask_mode, generator=torch.Generator().manual_seed(0), **cat_kw)
    step = CapturedStep(cat, opt, warmup_steps=1, autocast=autocast, max_grad_norm=1e6, share_rows=share_rows)
    losses, weights, norms = [], [], []
    for batch in _gpu_batches():
        loss, info = step(batch)
        losses.append(float(loss))
        weights.append(float(info["crm_weight_mean"]))
        norms.append(float(step.last_grad_norm))
    updates = {n: p.detach() - start[n] for n, p in model.named_parameters()}
    return losses, weights, updates, norms, step._packed_graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mask_mode", ["self", "union"])
def test_gpu_captured_cat_packed_equals_padded(autocast, mask_mode, monkeypatch):
    """`CapturedStep(CAT)` with ``PACKED = True`` (by default only from `CAT.packed_min_rows` rows) packs the clean
    forward on the rows CMIX reads (a shorter partner's padding rows too), the CAL and final passes on the same rows.
    Without dropout, against the
    padded captured step through 8 SGD steps: in fp32 the losses, CRM weights and the weights' updates to fp32
    rounding; in bf16 (variable-length attention, the keys gathered) the losses and weights to bf16 rounding and the
    whole update within 5 % of the padded one's norm."""
    (losses, weights, updates, _, graphs), (want_losses, want_weights, want_updates, _, want_graphs) = (
        _gpu_cat_step(packed, False, autocast, monkeypatch, mask_mode) for packed in (True, False))
    assert len(graphs) >= 1 and len(want_graphs) == 0  # union: a batch whose rows leave too little padding runs padded
    if mask_mode == "self":  # the layers past the mixing layer pack fewer rows: the graphs' row counts are pairs
        assert any("('rows', (" in repr(sig) for sig in graphs), graphs
    tol = dict(rtol=1e-4, atol=1e-5) if autocast is None else dict(rtol=3e-2, atol=3e-3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **tol)
    torch.testing.assert_close(torch.tensor(weights), torch.tensor(want_weights), **tol)
    if autocast is None:
        for name, a in updates.items():
            torch.testing.assert_close(a, want_updates[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        return
    a, b = (torch.cat([u.flatten() for u in d.values()]) for d in (updates, want_updates))
    assert (a - b).norm() <= 0.05 * b.norm(), float((a - b).norm() / b.norm())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_captured_packed_cat_passes_redraw_the_clean_dropout(monkeypatch):
    """Train mode with dropout: inside the packed graphs CAT's counterfactual pass redraws the clean forward's masks
    over the packed rows. At λ ≈ 0 (Beta(1e-6, 1e6), no CAL step) its logits are then the clean ones and every CRM
    weight is 1, in the padded graphs as in the packed ones (masks drawn anew move them by ~1e-2)."""
    near_zero = dict(adv_steps=0, alpha=1e-6, beta=1e6)
    losses, weights, _, norms, graphs = _gpu_cat_step(True, True, None, monkeypatch, **near_zero)
    _, want_weights, _, _, _ = _gpu_cat_step(False, True, None, monkeypatch, **near_zero)
    assert len(graphs) >= 2  # the partners' draws vary the counts: each new one captured at first sight
    assert all(map(math.isfinite, losses + norms))
    torch.testing.assert_close(torch.tensor(want_weights, dtype=torch.float64), torch.ones(8, dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.tensor(weights, dtype=torch.float64), torch.ones(8, dtype=torch.float64), rtol=0, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_the_lent_rows_lane_changes_no_number(monkeypatch):
    """The lent rows' work on a stream of its own (`packing.LENT_LANE`, beside each layer's work on the real rows,
    where the rows attend by variable-length attention): bf16 autocast, train mode with dropout (the fused kernels'
    own draws), captured packed CAT steps give bit for bit the losses, CRM weights and weight updates of the same
    steps with the lent rows on the layer's stream (the same kernels and draws, issued in the same order), and the
    lane ran."""
    monkeypatch.setattr(training_layer, "FUSED_MIN_ROWS", 0)
    lanes = []
    lane = packing._Lent.lane
    monkeypatch.setattr(packing._Lent, "lane", lambda self, tensors: _counted(lanes, lane(self, tensors)))
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(packing, "LENT_LANE", on)
        lanes.clear()
        torch.manual_seed(0)
        runs[on] = _gpu_cat_step(True, True, torch.bfloat16, monkeypatch)
        assert bool(lanes) == on  # eager steps and captures (replays run no Python)
    (losses, weights, updates, _, graphs), (want_losses, want_weights, want_updates, _, _) = runs[True], runs[False]
    assert len(graphs) >= 1 and all(map(math.isfinite, losses))
    assert losses == want_losses and weights == want_weights
    for name, a in updates.items():
        assert torch.equal(a, want_updates[name]), name


def _counted(calls, lane):
    if lane is not None:
        calls.append(lane)
    return lane


def _shrinking_batches(pattern):
    """CUDA batches of 4 × 40 tokens, by letter: "A" the lengths [40, 17, 25, 9] (91 real rows: a graph of 95, a
    32nd of the 160 rows being 5), "B" the same with the longest one token shorter (90 rows: a graph of 90, which A's
    covers within 1/8 of the rows; no partner lends it more rows than A's)."""
    lengths = {"A": [40, 17, 25, 9], "B": [39, 17, 25, 9]}
    for name in pattern:
        batch = tiny_batch("bert", batch=4, length=40, seed=0)
        batch["attention_mask"] = (torch.arange(40) < torch.tensor(lengths[name])[:, None]).long()
        batch["labels"] = torch.tensor([0, 1, 2, 0])
        yield {k: v.cuda() for k, v in batch.items()}


def _shrinking_erm_steps(pattern, monkeypatch, **step_kw):
    """The packed captured ERM step (eval mode) over `_shrinking_batches(pattern)` against the padded captured step:
    the losses and weights to fp32 rounding; ``(graphs, replays, shared replays)`` of the packed one."""
    from cat_fast import step as step_module

    results = {}
    for packed in ("auto", False):
        model, _, opt = _gpu_model(packed, False, monkeypatch)
        step = step_module.CapturedStep(ERM(model, fast=True), opt, **step_kw)
        losses = [float(step(batch)[0]) for batch in _shrinking_batches(pattern)]
        results[packed] = (losses, [p.detach().clone() for p in model.parameters()],
                           (step.num_graphs, step.num_replays, step.num_shared_replays))
    (losses, weights, counts), (want_losses, want_weights, _) = results["auto"], results[False]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-4, atol=1e-5)
    for a, b in zip(weights, want_weights):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    return counts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("share_rows", [0.125, 0.0])
def test_gpu_a_packed_step_replays_a_captured_graph_of_more_rows(share_rows, monkeypatch):
    """``CapturedStep(share_rows=1/8)``: B's steps replay A's graph (its 5 more rows computed as padding) until B has
    shared `OWN_GRAPH_AFTER` times (2 here), then B gets its own graph, captured at once (the batch shape is warm);
    with ``share_rows=0`` B is captured at its first step. Eval mode: the losses and weights of the padded captured
    step."""
    from cat_fast import step as step_module

    monkeypatch.setattr(step_module, "OWN_GRAPH_AFTER", 2)
    # A: eager, capture; B: shared twice, capture, two replays (share_rows=0: capture, four replays)
    counts = _shrinking_erm_steps("AABBBBB", monkeypatch, warmup_steps=1, share_rows=share_rows)
    assert counts == (2, 6, 2 if share_rows else 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_the_row_counts_of_a_batch_shape_warm_up_together(monkeypatch):
    """``warmup_steps=2`` counts the eager steps of a batch shape's packed signatures together: after A's and B's one
    eager step each, both are captured (each signature apart would take four eager steps before its first capture)."""
    assert _shrinking_erm_steps("ABABAB", monkeypatch, warmup_steps=2, share_rows=0) == (2, 4, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_shared_cat_graph_redraws_the_clean_dropout(monkeypatch):
    """Train mode with dropout, B's CAT steps replaying A's graph (the same partners: the generator reseeded): the
    counterfactual pass redraws the clean forward's masks over the graph's rows (the dropout offsets measured for
    A's count), so at λ ≈ 0 every CRM weight is 1, as in `test_gpu_captured_packed_cat_passes_redraw_the_clean_dropout`."""
    from cat_fast.step import CapturedStep

    model, _, opt = _gpu_model(True, True, monkeypatch)
    cat = CAT(model, layers=[2], adv_steps=0, alpha=1e-6, beta=1e6, generator=torch.Generator())
    step = CapturedStep(cat, opt, warmup_steps=1, max_grad_norm=1e6)
    weights = []
    for batch in _shrinking_batches("AABBB"):
        cat.generator.manual_seed(0)
        weights.append(float(step(batch)[1]["crm_weight_mean"]))
    assert step.num_shared_replays == 3 and step.num_graphs == 1
    torch.testing.assert_close(torch.tensor(weights, dtype=torch.float64), torch.ones(5, dtype=torch.float64),
                               rtol=0, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("objective", ["cat", "gs"])
def test_gpu_a_capture_measures_the_dropout_lead_an_eager_step_measures(objective, monkeypatch):
    """`models.PassGenerators` inside a capture: the offset the clean forward's draws have reached at the marker,
    read within the graph (`ops.fused.rng_offset`), less the capture's start, must be the lead an eager step of the
    same packed rows measures (else `_record` raises, the capture fails with a warning and the count runs eagerly).
    With `COUNT_WARMUP` = 1 each of the two row counts has an eager step before its capture, so every capture
    measures a lead already measured: both counts are captured, each capture records its lead, and no warning."""
    from cat_fast import step as step_module
    from cat_fast.models import PassGenerators
    from cat_fast.ops.fused import rng_offset_available

    assert rng_offset_available()
    monkeypatch.setattr(step_module, "COUNT_WARMUP", 1)
    in_capture = []
    record = PassGenerators._record

    def spy(self, lead):
        if torch.cuda.is_current_stream_capturing():
            in_capture.append((packing.static_count(), lead))
        return record(self, lead)

    monkeypatch.setattr(PassGenerators, "_record", spy)
    model, _, opt = _gpu_model(True, True, monkeypatch)
    if objective == "cat":
        made = CAT(model, layers=[2], adv_steps=1, generator=torch.Generator().manual_seed(0))
        args = ()
    else:
        made = GradientSupervision(model, weight=1.0, representation=0, mode="first_order", low_memory=False,
                                   difference="central", eps=1e-2)
        args = (PAIRS.cuda(),)
    step = step_module.CapturedStep(made, opt, warmup_steps=1, max_grad_norm=1e6, share_rows=0)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed capture warns
        for i, batch in enumerate(_gpu_batches()):
            if objective == "cat":  # the partners repeat with the batch: two row counts
                made.generator.manual_seed(i % 2)
            losses.append(float(step(batch, *args)[0]))
    assert all(map(math.isfinite, losses))
    assert len(step._packed_graphs) == 2 and step.num_replays == 6, (step._packed_graphs, step.num_replays)
    assert len({rows for rows, _ in in_capture}) == 2 and all(lead > 0 for _, lead in in_capture), in_capture
