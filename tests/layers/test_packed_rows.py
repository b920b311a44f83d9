"""The training layer's packed path (`layers.training.PACKED`, `layers.packing`): the row-wise work on the real
rows only, against the padded path (output on real rows, input and every parameter gradient), the padding rows'
documented values, the masks it reads, and whole models (`models.first_token_forward`, ERM) with it on and off."""
import pytest
import torch
import torch.nn.functional as F

from cat_fast import models
from cat_fast.layers import packing
from cat_fast.layers import training as training_layer
from cat_fast.objectives import ERM
from tests.conftest import tiny_batch, tiny_model

D = 32


@pytest.fixture
def packed_runs(monkeypatch):
    """Each `packing.attend` call of the training layer: True where it ran packed (real rows given)."""
    runs = []
    original = packing.attend

    def counted(*args):
        runs.append(args[-1] is not None)
        return original(*args)

    monkeypatch.setattr(packing, "attend", counted)
    return runs


def _padding_mask(lengths, T):
    return (torch.arange(T) < torch.tensor(lengths)[:, None]).long()


def _layer(train=False, **extra):
    model = tiny_model("bert", attn="sdpa", dtype=torch.float64, num_layers=2, hidden_dropout_prob=0.3,
                       attention_probs_dropout_prob=0.3, **extra)
    return models.structure(model).layer_modules[1].train(train)


def _run(layer, x, mask, g, packed, monkeypatch, seed=3):
    """(output, gradients of the input and of every parameter) of the training layer, packed or padded."""
    monkeypatch.setattr(training_layer, "PACKED", packed)
    torch.manual_seed(seed)
    t = x.detach().requires_grad_(True)
    y = training_layer.forward(layer, (t, mask), {})
    assert y is not None and y.shape == x.shape
    return y, torch.autograd.grad(y, [t, *layer.parameters()], g)


def _real(lengths, T):
    return _padding_mask(lengths, T).bool()


@pytest.mark.parametrize("case", ["plain", "one_real_token", "batch_of_one", "non_contiguous", "attention_dropout"])
def test_packed_equals_padded_on_real_rows_and_in_every_gradient(case, monkeypatch, packed_runs):
    """Without hidden dropout, an output gradient that is zero on the padding rows (as in a model): the real rows'
    output, the input gradient (zero on padding rows in both: nothing real depends on them) and every parameter
    gradient are the padded path's; the padding rows of the output are the input's."""
    T = 9
    lengths = {"one_real_token": [1, 5, 1, 1], "batch_of_one": [5]}.get(case, [9, 4, 6, 3])
    layer = _layer(train=case == "attention_dropout")
    layer.output.dropout.p = layer.attention.output.dropout.p = 0.0  # attention dropout: the same draws
    real = _real(lengths, T)
    mask = models.inputs._padding_mask_4d(real.long())
    B = len(lengths)
    x = torch.randn(B, T, D, dtype=torch.float64)
    if case == "non_contiguous":
        x = torch.randn(B, D, T, dtype=torch.float64).transpose(1, 2)
        assert not x.is_contiguous()
    g = torch.randn(B, T, D, dtype=torch.float64) * real[..., None]
    y_pad, grads_pad = _run(layer, x, mask, g, False, monkeypatch)
    y, grads = _run(layer, x, mask, g, True, monkeypatch)
    assert packed_runs == [False, True]
    torch.testing.assert_close(y[real], y_pad[real], rtol=1e-12, atol=1e-12)
    assert torch.equal(y[~real], x[~real])  # the documented padding rows: the layer's input
    assert torch.equal(grads_pad[0][~real], torch.zeros_like(grads_pad[0][~real]))
    for a, b in zip(grads, grads_pad):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert not torch.equal(grads[1], torch.zeros_like(grads[1]))


def test_the_padding_rows_pass_the_output_gradient(monkeypatch, packed_runs):
    """The output copies the input's padding rows: their input gradient is the output gradient there."""
    lengths, T = [9, 4, 6, 3], 9
    layer = _layer()
    real = _real(lengths, T)
    mask = models.inputs._padding_mask_4d(real.long())
    x = torch.randn(4, T, D, dtype=torch.float64)
    g = torch.randn(4, T, D, dtype=torch.float64)
    _, (grad_x, *_) = _run(layer, x, mask, g, True, monkeypatch)
    assert packed_runs == [True]
    assert torch.equal(grad_x[~real], g[~real])


@pytest.mark.parametrize("lengths", [[9, 9, 9, 9], [9, 9, 9, 8], [0, 0, 0, 0]],
                         ids=["no_padding", "below_threshold", "no_real_row"])
def test_too_little_padding_or_no_real_row_runs_the_padded_path(lengths, monkeypatch, packed_runs):
    layer = _layer(train=True)
    mask = models.inputs._padding_mask_4d(_padding_mask(lengths, 9))
    x = torch.randn(4, 9, D, dtype=torch.float64)
    g = torch.randn(4, 9, D, dtype=torch.float64)
    y_pad, grads_pad = _run(layer, x, mask, g, False, monkeypatch)
    y, grads = _run(layer, x, mask, g, True, monkeypatch)
    assert packed_runs == [False, False]
    torch.testing.assert_close(y, y_pad, rtol=0, atol=0, equal_nan=True)
    for a, b in zip(grads, grads_pad):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_train_mode_with_dropout_runs_packed_and_is_finite(monkeypatch, packed_runs):
    layer = _layer(train=True)
    real = _real([9, 4, 6, 3], 9)
    mask = models.inputs._padding_mask_4d(real.long())
    x = torch.randn(4, 9, D, dtype=torch.float64)
    g = torch.randn(4, 9, D, dtype=torch.float64) * real[..., None]
    y, grads = _run(layer, x, mask, g, True, monkeypatch)
    assert packed_runs == [True]
    assert torch.isfinite(y).all() and all(torch.isfinite(gr).all() for gr in grads)
    y_other, _ = _run(layer, x, mask, g, True, monkeypatch, seed=4)
    assert (y - y_other)[real].abs().max() > 1e-3  # dropout drew masks


def test_gradcheck_float64(monkeypatch, packed_runs):
    """Input (padding rows included) and parameter gradients of the packed layer against finite differences (a
    narrow layer: gradcheck perturbs every entry)."""
    monkeypatch.setattr(training_layer, "PACKED", True)
    layer = _layer(hidden_size=8, num_attention_heads=2, intermediate_size=12)
    mask = models.inputs._padding_mask_4d(_padding_mask([5, 2], 5))
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    params = (layer.attention.self.query.weight, layer.attention.self.value.bias, layer.attention.output.dense.weight,
              layer.attention.output.LayerNorm.weight, layer.intermediate.dense.weight, layer.output.LayerNorm.bias)
    assert torch.autograd.gradcheck(lambda t, *_: training_layer.forward(layer, (t, mask), {}), (x, *params))
    assert packed_runs and all(packed_runs)


def _mask_forms(lengths, T):
    real = _real(lengths, T)
    bool4 = models.inputs._padding_mask_4d(real.long())
    additive = torch.zeros(bool4.shape, dtype=torch.float64)
    return {"bool": bool4, "bool_one_query_row": bool4[:, :, :1],
            "min": additive.masked_fill(~bool4, torch.finfo(torch.float64).min),
            "-inf": additive.masked_fill(~bool4, float("-inf")).float()}


@pytest.mark.parametrize("form", ["bool", "bool_one_query_row", "min", "-inf"])
def test_the_real_rows_of_each_key_padding_mask_form(form):
    lengths, T = [9, 4, 6, 3], 9
    mask = _mask_forms(lengths, T)[form]
    idx = packing.real_rows(mask, 4, T, 0.125)
    torch.testing.assert_close(idx, _real(lengths, T).reshape(-1).nonzero().squeeze(1), rtol=0, atol=0)
    shared = mask[:1].clone()  # one mask for the whole batch
    torch.testing.assert_close(packing.real_rows(shared, 3, T, 0.0), torch.arange(27),
                               rtol=0, atol=0)


def test_masks_whose_padding_cannot_be_read_run_padded():
    T = 9
    forms = _mask_forms([9, 4, 6, 3], T)
    causal = forms["bool"] & torch.ones(T, T, dtype=torch.bool).tril()
    biased = forms["min"].clone()
    biased[0, 0, :, 1] = -1.0  # an additive bias, not a padding mask
    per_head = forms["bool"].expand(4, 2, T, T)
    for mask in (causal, biased, per_head, forms["bool"].long(), forms["bool"][:, :, :, :8]):
        assert packing.real_rows(mask, 4, T, 0.0) is None
    assert packing.real_rows(forms["bool"], 4, T, 0.0) is not None


def test_the_rows_are_read_once_per_mask_until_it_changes(monkeypatch):
    calls = []
    original = packing._real_keys
    monkeypatch.setattr(packing, "_real_keys", lambda *a: calls.append(1) or original(*a))
    mask = _mask_forms([9, 4, 6, 3], 9)["bool"]
    first = packing.real_rows(mask, 4, 9, 0.125)
    assert packing.real_rows(mask, 4, 9, 0.125) is first and len(calls) == 1
    mask[1, ..., 3] = False  # in place: read again
    again = packing.real_rows(mask, 4, 9, 0.125)
    assert len(calls) == 2 and again.numel() == first.numel() - 1
    assert packing.real_rows(mask.clone(), 4, 9, 0.125) is not again and len(calls) == 3


def _model_batch():
    batch = tiny_batch("bert", batch=4, length=12)
    batch["attention_mask"] = _padding_mask([12, 5, 8, 3], 12)
    batch["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 0)
    return batch


def _first_token_step(model, batch, seed=5):
    """Logits, parameter gradients and the gradient w.r.t. the embeddings' output of a first-token forward with the
    training layers."""
    outs = []
    handle = model.base_model.embeddings.register_forward_hook(lambda m, i, o: outs.append(o))
    try:
        torch.manual_seed(seed)
        logits = models.first_token_forward(model, batch, training_layers=True).logits
    finally:
        handle.remove()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(F.cross_entropy(logits, batch["labels"]), [outs[-1], *params], allow_unused=True)
    return logits, grads[0], grads[1:]


def _compare_first_token(model, batch, monkeypatch, packed_runs, pack_calls, want_calls, want_runs=None,
                         last_packed=True):
    """A first-token forward with the packed path against the padded one: logits, the embeddings' output gradient
    (zero on padding rows in both where the head reads real rows only) and every parameter gradient in float64;
    `want_calls`: the pack / unpack calls of the packed forward; `want_runs`: how many layers attend (packed in the
    packed forward); `last_packed`: whether the packed forward's last layer reads the packed rows (where any are)."""
    from cat_fast.layers import attention

    real = batch["attention_mask"].bool()
    _first_token_step(model, batch)  # the layers' output format recorded
    first_rows = []
    original = attention.first_row_packed
    monkeypatch.setattr(attention, "first_row_packed", lambda *a: first_rows.append(1) or original(*a))
    results = {}
    for packed in (False, True):
        monkeypatch.setattr(training_layer, "PACKED", packed)
        pack_calls.clear()
        packed_runs.clear()
        first_rows.clear()
        results[packed] = _first_token_step(model, batch)
        assert pack_calls == (want_calls if packed else [])
        # the first-token last layer reads the packed rows (its attention over each sequence's packed keys)
        assert first_rows == ([1] if packed and want_calls and last_packed else [])
        if want_runs is not None:
            assert packed_runs == [packed] * want_runs
    (logits, grad_emb, grads), (want_logits, want_emb, want) = results[True], results[False]
    torch.testing.assert_close(logits, want_logits, rtol=1e-12, atol=1e-12)
    if real[:, 0].all():  # the head reads real rows only
        for emb in (grad_emb, want_emb):
            assert torch.equal(emb[~real], torch.zeros_like(emb[~real]))
    torch.testing.assert_close(grad_emb, want_emb, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_first_token_forward_with_packed_layers_equals_padded(monkeypatch, packed_runs, pack_calls):
    """Eval mode: the same logits and parameter gradients; in both, the gradient w.r.t. every padding row of the
    embeddings' output is exactly zero (nothing the loss reads depends on padding rows). Layers 0 and 1 attend
    packed; the last runs for the first token, on the packed rows."""
    model = tiny_model("bert", attn="sdpa", dtype=torch.float64, num_layers=3).eval()
    _compare_first_token(model, _model_batch(), monkeypatch, packed_runs, pack_calls, ["pack", "unpack"],
                         want_runs=2)


@pytest.mark.parametrize("padding", ["right", "left", "all_padding_but_one"])
def test_packed_rows_stay_packed_between_layers(padding, monkeypatch, packed_runs, pack_calls):
    """Five layers in a first-token forward: the rows are packed once (layer 0) and unpacked once (by the last,
    first-token layer, which reads them packed and unpacks its input's rows for its output's rows 1..), not per
    layer; logits and every gradient equal the padded path's in float64. Left padding (a first position that is
    padding, which the head reads) runs the padded path."""
    model = tiny_model("bert", attn="sdpa", dtype=torch.float64, num_layers=5).eval()
    batch = _model_batch()
    if padding == "left":
        batch["attention_mask"] = batch["attention_mask"].flip(1)
    elif padding == "all_padding_but_one":
        batch["attention_mask"][1:, 1:] = 0
    batch["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 0)
    want = [] if padding == "left" else ["pack", "unpack"]
    _compare_first_token(model, batch, monkeypatch, packed_runs, pack_calls, want)


def test_a_layer_with_a_hook_keeps_every_layer_unpacked(monkeypatch, packed_runs, pack_calls):
    """A forward hook on a layer could read its output: no layer hands packed rows on (each packs and unpacks)."""
    model = tiny_model("bert", attn="sdpa", dtype=torch.float64, num_layers=5).eval()
    seen = []
    models.structure(model).layer_modules[2].register_forward_hook(
        lambda m, i, o: seen.append((o[0] if isinstance(o, tuple) else o).shape))
    _compare_first_token(model, _model_batch(), monkeypatch, packed_runs, pack_calls, ["pack", "unpack"] * 4,
                         last_packed=False)
    assert set(seen) == {torch.Size([4, 12, D])}


def test_a_layer_that_declines_packed_rows_gets_them_unpacked(monkeypatch, packed_runs, pack_calls):
    """A layer whose fast path declines the call (here forced) runs the model's own layer on the unpacked hidden
    states; the layers after it pack again. The same values and gradients as the padded path."""
    model = tiny_model("bert", attn="sdpa", dtype=torch.float64, num_layers=5).eval()
    declining = models.structure(model).layer_modules[2]
    original = training_layer.forward
    monkeypatch.setattr(training_layer, "forward",
                        lambda layer, args, kwargs: None if layer is declining else original(layer, args, kwargs))
    _compare_first_token(model, _model_batch(), monkeypatch, packed_runs, pack_calls,
                         ["pack", "unpack", "pack", "unpack"])


def test_unpacks_hand_the_full_gradient_to_their_pack():
    """`unpack(..., link)` leaves `full`'s gradient to the `pack` the rows descend from, which overwrites its rows:
    the same gradients as the unlinked pair, with two unpacks of one chain (a captured layer's and the last), a
    retained graph whose first backward stops short of the pack (nothing left behind for the second), and rows
    that record no gradient."""
    torch.manual_seed(0)
    real = _real([5, 2, 4], 6)
    mask = models.inputs._padding_mask_4d(real.long())
    plan = packing.plan(mask, 3, 6, 0.0)
    weight = torch.randn(D, D, dtype=torch.float64)

    def run(linked):
        hidden = torch.randn(3, 6, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        hidden.requires_grad_(True)
        rows = packing.pack(hidden, plan)
        link = packing.link(rows) if linked else None
        assert link is not None or not linked
        mid = torch.tanh(rows @ weight)
        captured = packing.unpack(mid, plan, hidden, link)
        out = packing.unpack(torch.tanh(mid @ weight), plan, hidden, link)
        loss = (out ** 2).sum() + (captured * out.detach()).sum()
        (short,) = torch.autograd.grad(loss, mid, retain_graph=True)  # runs the unpacks, not the pack
        (grad,) = torch.autograd.grad(loss, hidden)
        return short, grad

    (short, grad), (want_short, want) = run(True), run(False)
    assert torch.equal(short, want_short) and torch.equal(grad, want)
    assert grad[~real].ne(0).all()  # the padding rows pass both unpacks' gradients
    with torch.no_grad():
        rows = packing.pack(torch.randn(3, 6, D, dtype=torch.float64), plan)
    assert packing.link(rows) is None


def test_the_varlen_offsets_of_a_plan():
    """`Plan.offsets`: each sequence's real rows, then a static count's extra padding rows in spans of at most T. A
    sequence whose first position is padding (left padding, an all-padding row) gives no plan: the padded path."""
    real = _real([9, 4, 1, 3], 9)
    mask = models.inputs._padding_mask_4d(real.long())
    plan = packing.plan(mask, 4, 9, 0.0)
    cu, longest = plan.offsets()
    assert cu.dtype == torch.int32 and longest == 9 and cu.tolist() == [0, 9, 13, 14, 17]
    with packing.static_rows(30):
        plan = packing.plan(mask, 4, 9, 0.0)
    cu, _ = plan.offsets()
    assert cu.tolist() == [0, 9, 13, 14, 17, 26, 30, 30, 30]  # 13 extra rows: 9 + 4, then empty spans
    assert plan.idx[:17].tolist() == real.reshape(-1).nonzero().squeeze(1).tolist()
    for lengths in ([9, 4, 0, 3], [0, 0, 0, 0]):
        assert packing.plan(models.inputs._padding_mask_4d(_real(lengths, 9).long()), 4, 9, 0.0) is None
    left = models.inputs._padding_mask_4d(_real([9, 4, 1, 3], 9).flip(1).long())
    assert packing.plan(left, 4, 9, 0.0) is None
    with packing.static_rows(30), pytest.raises(RuntimeError):
        packing.plan(left, 4, 9, 0.0)


def test_the_attention_layout_of_extended_rows():
    """`packing.extended`: a plan packs the given rows (a shorter sequence's padding rows too), its keys stay the
    mask's real rows: query offsets over the rows packed, key offsets over the keys, and the key rows gathered keys
    first (then a static count's extra rows, spans of their own, then the packed padding rows, no key). Rows that
    leave a key out give no plan (eagerly; a device assertion with a static count)."""
    real = _real([9, 4, 1, 3], 9)
    mask = models.inputs._padding_mask_4d(real.long())
    rows = _real([9, 6, 1, 5], 9)
    with packing.extended(rows):
        plan = packing.plan(mask, 4, 9, 0.0)
    assert plan.idx.tolist() == rows.reshape(-1).nonzero().squeeze(1).tolist()
    cu_q, longest, cu_k, keys = plan.attention_layout()
    assert cu_q.tolist() == [0, 9, 15, 16, 21] and longest == 9 and cu_k.tolist() == [0, 9, 13, 14, 17]
    assert keys.tolist() == [*range(13), 15, 16, 17, 18, 13, 14, 19, 20]
    # each row's place among the gathered keys (their gradients go back by it), -1: a packed padding row, no key
    assert plan.key_sources().tolist() == [*range(13), -1, -1, 13, 14, 15, 16, -1, -1]
    assert plan.key_sources() is plan.key_sources()
    assert plan.offsets()[0] is cu_q
    with packing.extended(rows):  # one plan per mask and rows while both are alive and unchanged
        again = packing.plan(mask, 4, 9, 0.0)
        assert packing.plan(mask, 4, 9, 0.0) is again
    with packing.extended(rows.clone()):
        assert packing.plan(mask, 4, 9, 0.0) is not again
    assert packing.plan(mask, 4, 9, 0.0).rows is packing.plan(mask, 4, 9, 0.0).real  # outside: the real rows
    with packing.extended(rows), packing.static_rows(30):
        plan = packing.plan(mask, 4, 9, 0.0)
    cu_q, _, cu_k, keys = plan.attention_layout()
    assert cu_q.tolist() == [0, 9, 15, 16, 21, 30, 30, 30, 30]  # 9 extra rows
    assert cu_k.tolist() == [0, 9, 13, 14, 17, 26, 26, 26, 26]  # the keys, then the same 9 extra rows
    assert keys.tolist() == [*range(13), 15, 16, 17, 18, *range(21, 30), 13, 14, 19, 20]
    assert plan.key_sources().tolist() == [*range(13), -1, -1, 13, 14, 15, 16, -1, -1, *range(17, 26)]
    assert packing.plan(mask, 4, 9, 0.0).key_sources() is None  # every packed row a key
    with packing.extended(_real([9, 3, 1, 5], 9)):  # the second sequence's fourth key is left out
        assert packing.plan(mask, 4, 9, 0.0) is None
        with packing.static_rows(30), pytest.raises(RuntimeError):
            packing.plan(mask, 4, 9, 0.0)
    with pytest.raises(ValueError, match="rows must be a \\[B, T\\] boolean tensor"):
        packing.extended(real.long())


def test_lent_rows_their_layout_and_bad_arguments():
    """`packing.lent`: the rows marked, their offsets per sequence and where each is written back; under a static
    triple the spare rows after them go to the scratch row B·T, which `with_lent` drops; `lent_rows` hands them over
    once; a wrong argument raises naming it."""
    lent = torch.zeros(3, 4, dtype=torch.bool)
    lent[0, 3] = lent[2, 1] = lent[2, 2] = True
    with packing.lent(lent):
        state = packing.lent_state()
        assert state.idx.tolist() == state.dest.tolist() == [3, 9, 10] and state.cu.tolist() == [0, 1, 1, 3]
        assert packing.lent_rows() is None and state.done  # no layer carried them: the padded path computed them
    with packing.static_rows((8, 8, 5)), packing.lent(lent):
        state = packing.lent_state()
        assert state.idx[:3].tolist() == [3, 9, 10] and state.dest.tolist() == [3, 9, 10, 12, 12]
        state.x = torch.arange(5.0).repeat_interleave(2).view(5, 2) + 1
        dest, rows = packing.lent_rows()
        assert packing.lent_rows() is None  # handed over once
        hidden = torch.zeros(3, 4, 2, requires_grad=True)
        out = packing.with_lent(hidden, dest, rows)
        assert not out.requires_grad and out.shape == (3, 4, 2)
        assert out[0, 3].tolist() == [1, 1] and out[2, 1].tolist() == [2, 2] and out[2, 2].tolist() == [3, 3]
        assert out.sum() == 12  # the spare rows 4 and 5 written nowhere
    with packing.static_rows((8, 8, 0)), packing.lent(torch.zeros(3, 4, dtype=torch.bool)):
        assert packing.lent_state() is None  # no row lent
    with packing.lent(lent):
        packing.lent_state().x, packing.lent_state().broken = torch.zeros(3, 2), True
        with pytest.raises(RuntimeError, match="did not run packed"):
            packing.lent_rows()
    with pytest.raises(ValueError, match=r"packing.lent: rows must be a \[B, T\] boolean tensor"):
        packing.lent(lent.long())
    with pytest.raises(ValueError, match="packing.static_rows: expected a row count, or a pair or triple"):
        packing.static_rows((8, 8, -1))
    with pytest.raises(ValueError, match="packing.static_rows"):
        packing.static_rows((8, 8, 4, 4))



def test_the_lent_rows_lane_is_cuda_only_and_its_switch_is_checked(monkeypatch):
    """`packing.LENT_LANE`: no lane off CUDA (the rows run on the layer's stream, nothing kept); a value other than
    True or False raises naming it. The lane itself: `test_gpu_the_lent_rows_lane_changes_no_number`."""
    lent = torch.zeros(2, 3, dtype=torch.bool)
    lent[1, 2] = True
    with packing.lent(lent):
        state = packing.lent_state()
        state.x = torch.zeros(1, 4)
        assert state.lane((torch.ones(2),)) is None and state.kept == [] and state.joins == {}
        monkeypatch.setattr(packing, "LENT_LANE", "yes")
        with pytest.raises(ValueError, match="packing.LENT_LANE: expected True or False, got 'yes'"):
            state.lane(())

@pytest.mark.parametrize("train", [False, True])
def test_erm_fast_step_with_packed_layers(train, monkeypatch, packed_runs):
    """ERM(fast=True): eval mode, the same loss and gradients; train mode (dropout), both finite, of one shape."""
    model = tiny_model("bert", attn="sdpa", dtype=torch.float64, num_layers=3, hidden_dropout_prob=0.2,
                       attention_probs_dropout_prob=0.2).train(train)
    batch = _model_batch()
    erm = ERM(model, fast=True)
    erm(batch)  # the layers' output format recorded
    results = {}
    for packed in (False, True):
        monkeypatch.setattr(training_layer, "PACKED", packed)
        packed_runs.clear()
        torch.manual_seed(7)
        loss, _ = erm(batch)
        assert packed_runs == [packed] * 2
        results[packed] = (loss, torch.autograd.grad(loss, list(model.parameters()), allow_unused=True))
    (loss, grads), (want_loss, want) = results[True], results[False]
    assert torch.isfinite(loss) and loss.shape == want_loss.shape
    for a, b in zip(grads, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.shape == b.shape and torch.isfinite(a).all()
            if not train:
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    if not train:
        torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
    else:
        assert not torch.equal(loss, want_loss)  # other dropout draws over the real rows



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("autocast", [False, True])
def test_packed_on_cuda_agrees_and_a_capture_runs_padded(autocast, monkeypatch, packed_runs):
    """fp32, and bf16 autocast with the fused kernels (from any row count): the packed path's real rows and
    gradients are the padded path's to rounding; while a CUDA graph is captured the padded path runs."""
    monkeypatch.setattr(training_layer, "FUSED_MIN_ROWS", 0)
    model = tiny_model("bert", attn="sdpa", num_layers=2, hidden_size=64, num_attention_heads=4,
                       intermediate_size=256).cuda()
    layer = models.structure(model).layer_modules[1].eval()
    real = _real([40, 17, 25, 9, 33, 40], 40).cuda()
    mask = models.inputs._padding_mask_4d(real.long())
    x = torch.randn(6, 40, 64, device="cuda")
    g = torch.randn(6, 40, 64, device="cuda") * real[..., None]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        (y_pad, grads_pad), (y, grads) = (_run(layer, x, mask, g, packed, monkeypatch) for packed in (False, True))
    assert packed_runs == [False, True]
    tol = 3e-2 if autocast else 1e-4
    torch.testing.assert_close(y[real], y_pad[real], rtol=tol, atol=tol)
    assert torch.equal(y[~real], x[~real])
    names = ["input"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, grads, grads_pad):
        if not name.endswith("key.bias"):  # exactly 0 in exact arithmetic: rounding noise on both sides
            assert (a - b).abs().max() <= tol * b.abs().max().clamp_min(1e-6), name
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    packed_runs.clear()
    _run(layer, x, mask, g, True, monkeypatch)
    assert packed_runs == [False]


# ----------------------------------------------------------------------------- static row counts (captured steps)

@pytest.mark.parametrize("extra", [0, 5], ids=["exact", "with_padding_rows"])
def test_static_rows_equal_the_padded_path(extra, monkeypatch, packed_runs):
    """`packing.static_rows(n)` (what a captured step runs under): the real rows and n − N padding rows, computed on
    the device. Real rows and every gradient are the padded path's; the padding rows it computes are the padded
    path's too (computed alike), the others the input's."""
    lengths, T = [9, 4, 6, 3], 9
    layer = _layer()
    real = _real(lengths, T)
    mask = models.inputs._padding_mask_4d(real.long())
    x = torch.randn(4, T, D, dtype=torch.float64)
    g = torch.randn(4, T, D, dtype=torch.float64) * real[..., None]
    y_pad, grads_pad = _run(layer, x, mask, g, False, monkeypatch)
    n = int(real.sum()) + extra
    with packing.static_rows(n):
        y, grads = _run(layer, x, mask, g, True, monkeypatch)
    assert packed_runs == [False, True]
    torch.testing.assert_close(y[real], y_pad[real], rtol=1e-12, atol=1e-12)
    padding = (~real).reshape(-1).nonzero().squeeze(1)
    computed, copied = padding[:extra], padding[extra:]
    torch.testing.assert_close(y.reshape(-1, D)[computed], y_pad.reshape(-1, D)[computed], rtol=1e-12, atol=1e-12)
    assert torch.equal(y.reshape(-1, D)[copied], x.reshape(-1, D)[copied])
    for a, b in zip(grads, grads_pad):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_static_rows_fewer_than_the_real_rows_fail_loudly(monkeypatch):
    """A static count below the real rows would drop real rows: the device-side assertion fails instead."""
    real = _real([9, 4, 6, 3], 9)
    mask = models.inputs._padding_mask_4d(real.long())
    with packing.static_rows(int(real.sum()) - 1), pytest.raises(RuntimeError):
        packing.real_rows(mask, 4, 9, training_layer.PACKED_MIN_PADDING)
    with packing.static_rows(int(real.sum())):
        idx = packing.real_rows(mask, 4, 9, training_layer.PACKED_MIN_PADDING)
    assert torch.equal(idx, real.reshape(-1).nonzero().squeeze(1))
    assert packing.static_count() is None  # the context restores it


def test_static_rows_assert_a_key_padding_mask():
    """Under a static count the mask's form is asserted on the device: a causal or biased mask fails loudly instead of
    being read as padding."""
    T = 9
    forms = _mask_forms([9, 4, 6, 3], T)
    causal = forms["bool"] & torch.ones(T, T, dtype=torch.bool).tril()
    biased = forms["min"].clone()
    biased[0, 0, :, 1] = -1.0
    for mask in (causal, biased):
        with packing.static_rows(30), pytest.raises(RuntimeError):
            packing.real_rows(mask, 4, T, 0.0)
    with packing.static_rows(30):
        assert packing.real_rows(forms["min"], 4, T, 0.0).shape == (30,)


@pytest.mark.parametrize("n_real, total, want", [(700, 1024, 704), (1, 1024, 32), (896, 1024, 896), (897, 1024, None),
                                                 (0, 1024, None), (1024, 1024, None), (22, 36, 22), (31, 36, None),
                                                 (8, 8, None)])
def test_bucket_rounds_up_to_a_32nd_of_the_rows(n_real, total, want):
    """Rounded up to a multiple of ceil(total / 32); None where that leaves less than 1/8 padding or no real row."""
    assert packing.BUCKETS == 32
    assert packing.bucket(n_real, total, training_layer.PACKED_MIN_PADDING) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_layers, autocast", [(2, None), (5, None), (5, torch.bfloat16)],
                         ids=["2_layers_fp32", "5_layers_fp32", "5_layers_bf16_varlen"])
def test_captured_erm_step_with_packed_layers_equals_padded(num_layers, autocast, monkeypatch):
    """`CapturedStep(ERM(fast=True))` with the packed path on: each graph packs its batch's real rows rounded up
    to a bucket (the graph count grows with the buckets, and replays happen); five layers hand the rows on packed,
    and under bf16 autocast attend by variable-length flash attention. Eval mode: the same losses and weights as the
    padded captured step, to fp32 rounding (bf16: to its rounding, through 10 AdamW steps)."""
    from cat_fast.step import CapturedStep

    lengths = [[40, 17, 25, 9], [33, 12, 20, 21], [40, 17, 25, 9], [33, 12, 20, 21], [40, 38, 39, 40]]
    varlen = []
    original = packing.varlen_applies
    monkeypatch.setattr(packing, "varlen_applies", lambda *a: varlen.append(original(*a)) or varlen[-1])
    results = {}
    for packed in (False, True):
        monkeypatch.setattr(training_layer, "PACKED", packed)
        model = tiny_model("bert", attn="sdpa", num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                           intermediate_size=256, seed=0).cuda().eval()
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), capturable=True)
        step = CapturedStep(ERM(model, fast=True), opt, warmup_steps=1, autocast=autocast)
        losses = []
        for i, ls in enumerate(lengths * 2):
            batch = tiny_batch("bert", batch=4, length=40, seed=i % len(lengths))
            batch["attention_mask"] = _padding_mask(ls, 40)
            batch = {k: v.cuda() for k, v in batch.items()}
            losses.append(float(step(batch)[0]))
        results[packed] = losses, [p.detach().clone() for p in model.parameters()], step.num_graphs, step.num_replays
    (losses, weights, graphs, replays), (want_losses, want_weights, _, _) = results[True], results[False]
    assert graphs >= 2 and replays >= 4
    assert any(varlen) == (autocast is not None) and all(v == varlen[0] for v in varlen)
    tol = dict(rtol=1e-4, atol=1e-5) if autocast is None else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **tol)
    if autocast is not None:  # AdamW makes lr-sized steps of near-zero gradients' rounding noise: 2.3e-3 on an H200
        tol["atol"] = 3e-3
    for a, b in zip(weights, want_weights):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_attention_equals_the_padded_attention(dtype):
    """Variable-length flash attention over packed rows (`packing.attend` on CUDA, 16-bit) against SDPA in the
    padded layout with a key-padding mask, in fp32 from the same 16-bit inputs: the context of every real row and
    the gradient of every packed projection, to 16-bit rounding; B = 1, a one-token sequence, odd lengths, and a
    static count's extra padding rows (attending among themselves, finite, without gradient from real rows)."""
    torch.manual_seed(0)
    heads, width, T = 4, 64, 37
    lengths = [37, 1, 20, 9, 33]
    for lens, extra in ((lengths, 0), (lengths, 11), ([23], 0)):
        B = len(lens)
        real = _real(lens, T).cuda()
        mask = models.inputs._padding_mask_4d(real.long().cpu()).cuda()
        n = int(real.sum()) + extra
        with packing.static_rows(n if extra else None):
            plan = packing.plan(mask, B, T, 0.0)
        qkv = torch.randn(n, 3 * heads * width, device="cuda", dtype=dtype).requires_grad_(True)
        g = torch.randn(n, heads * width, device="cuda", dtype=dtype)
        assert packing.varlen_applies(qkv, width)
        rows, _ = packing.attend(qkv, (B, T, heads, width), None, 0.0, width ** -0.5, plan)
        (grad,) = torch.autograd.grad(rows, qkv, g, retain_graph=True)
        ref_qkv = qkv.detach().float().requires_grad_(True)
        full = ref_qkv.new_zeros(B * T, ref_qkv.shape[1]).index_copy(0, plan.idx, ref_qkv)
        q, k, v = (t.view(B, T, heads, width).transpose(1, 2) for t in full.split(heads * width, dim=1))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=real[:, None, None, :], scale=width ** -0.5)
        ref = ctx.transpose(1, 2).reshape(B * T, -1).index_select(0, plan.idx)
        n_real = int(real.sum())
        (ref_grad,) = torch.autograd.grad(ref[:n_real], ref_qkv, g[:n_real].float())
        tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
        torch.testing.assert_close(rows[:n_real].float(), ref[:n_real], rtol=tol, atol=tol)
        (grad_real,) = torch.autograd.grad(rows[:n_real], qkv, g[:n_real])
        torch.testing.assert_close(grad_real[:n_real].float(), ref_grad[:n_real], rtol=tol, atol=tol)
        assert torch.equal(grad_real[n_real:], torch.zeros_like(grad_real[n_real:]))  # extra rows: their own spans
        assert torch.isfinite(rows).all() and torch.isfinite(grad).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("extended", [False, True])
def test_gpu_attention_backward_sums_the_bias_gradient_as_it_joins_dq_dk_dv(extended):
    """`packing.attention_backward(..., column_sums=True)` after variable-length attention: the same gradient bits
    as without, and its column sums in fp32 (summed as the kernel joins dq, dk and dv), to fp32 rounding; a second
    backward of the retained graph without sums, and the padded layout, give None."""
    torch.manual_seed(1)
    heads, width, T = 12, 64, 50
    lens, ext = [50, 3, 27, 41], [50, 30, 27, 41]
    B = len(lens)
    real = _real(lens, T).cuda()
    mask = models.inputs._padding_mask_4d(real.long().cpu()).cuda()
    with packing.extended(_real(ext, T).cuda() if extended else None), packing.static_rows(150):
        plan = packing.plan(mask, B, T, 0.0)
    qkv = torch.randn(150, 3 * heads * width, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    g = torch.randn(150, heads * width, device="cuda", dtype=torch.bfloat16)
    rows, _ = packing.attend(qkv, (B, T, heads, width), None, 0.1, width ** -0.5, plan)
    torch.cuda.manual_seed(3)
    want, none = packing.attention_backward(rows, qkv, g, (B, T, heads, width), True)
    torch.cuda.manual_seed(3)
    got, sums = packing.attention_backward(rows, qkv, g, (B, T, heads, width), True, column_sums=True)
    assert none is None and torch.equal(got, want) and got.abs().sum() > 0
    assert sums.dtype == torch.float32 and sums.shape == (3 * heads * width,)
    torch.testing.assert_close(sums, want.float().sum(0), rtol=1e-5, atol=1e-4)
    again, none = packing.attention_backward(rows, qkv, g, (B, T, heads, width), True)
    assert none is None and torch.equal(again, want)
    padded_qkv = torch.randn(B * T, 3 * heads * width, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    context, _ = packing.attend(padded_qkv, (B, T, heads, width), mask, 0.0, width ** -0.5, None)
    grad, none = packing.attention_backward(context, padded_qkv, torch.randn(B * T, heads * width, device="cuda",
                                                                             dtype=torch.bfloat16),
                                            (B, T, heads, width), False, column_sums=True)
    assert none is None and grad.shape == padded_qkv.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_attention_of_extended_rows_equals_the_padded_attention(dtype):
    """Packed padding rows (`packing.extended`: the queries of a shorter sequence's padding positions, attending to
    its real keys, as the padded layout computes them) by variable-length flash attention with the keys gathered:
    the context of every packed row and the gradient of every projection against SDPA in the padded layout, to
    16-bit rounding; with and without a static count's extra rows, B = 1, a one-token sequence; the padding rows'
    key and value projections get no gradient."""
    torch.manual_seed(0)
    heads, width, T = 4, 64, 37
    for lens, ext, extra in (([37, 1, 20, 9, 33], [37, 30, 20, 37, 33], 0), ([37, 1, 20, 9, 33], [37, 30, 20, 37, 33], 11),
                             ([23], [31], 0), ([5, 1], [5, 5], 3)):
        B = len(lens)
        real, rows_mask = _real(lens, T).cuda(), _real(ext, T).cuda()
        mask = models.inputs._padding_mask_4d(real.long().cpu()).cuda()
        n = int(rows_mask.sum()) + extra
        with packing.extended(rows_mask), packing.static_rows(n if extra else None):
            plan = packing.plan(mask, B, T, 0.0)
        qkv = torch.randn(n, 3 * heads * width, device="cuda", dtype=dtype).requires_grad_(True)
        g = torch.randn(n, heads * width, device="cuda", dtype=dtype)
        rows, _ = packing.attend(qkv, (B, T, heads, width), None, 0.0, width ** -0.5, plan)
        packed = int(rows_mask.sum())
        (grad,) = torch.autograd.grad(rows[:packed], qkv, g[:packed])
        ref_qkv = qkv.detach().float().requires_grad_(True)
        full = ref_qkv.new_zeros(B * T, ref_qkv.shape[1]).index_copy(0, plan.idx, ref_qkv)
        q, k, v = (t.view(B, T, heads, width).transpose(1, 2) for t in full.split(heads * width, dim=1))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=real[:, None, None, :], scale=width ** -0.5)
        ref = ctx.transpose(1, 2).reshape(B * T, -1).index_select(0, plan.idx)
        (ref_grad,) = torch.autograd.grad(ref[:packed], ref_qkv, g[:packed].float())
        tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
        torch.testing.assert_close(rows[:packed].float(), ref[:packed], rtol=tol, atol=tol)
        torch.testing.assert_close(grad.float(), ref_grad, rtol=tol, atol=tol)
        key = real.reshape(-1).index_select(0, plan.idx)
        D = heads * width
        assert torch.equal(grad[~key, D:], torch.zeros_like(grad[~key, D:]))  # no key: no key or value gradient
        assert torch.isfinite(rows).all()


def test_which_steps_pack_by_default(monkeypatch):
    """`PACKED = "auto"` (the default): a captured step packs only for an objective that declares `packs_rows` (ERM
    fast, the bias-model losses and CAT with the training layers; not plain ERM), on CUDA, from `PACKED_MIN_ROWS`
    rows (CAT from its own `packed_min_rows`), and never a batch whose first position is padding; True packs any
    2-D-masked batch of such an objective; False none."""
    from cat_fast import step as step_module
    from cat_fast.objectives import CAT, PoE

    assert training_layer.PACKED == "auto"
    model = tiny_model("bert", attn="sdpa", num_layers=2)
    assert ERM(model, fast=True).packs_rows and not ERM(model).packs_rows
    assert PoE(model).packs_rows and not PoE(model, training_layers=False).packs_rows
    assert CAT(model).packs_rows and not CAT(model, gs_weight=0.5).packs_rows
    assert not CAT(model, training_layers=False).packs_rows
    # CAT from the default 4,096 rows with its lent rows carried apart, from 8,192 where they take a gradient
    assert CAT(model).packed_min_rows is None and step_module._min_rows(CAT(model)) == 4096
    assert step_module._min_rows(CAT(model, detach_weight=False)) == 8192
    assert step_module._min_rows(ERM(model, fast=True)) == training_layer.PACKED_MIN_ROWS == 4096
    batch = {"attention_mask": _padding_mask([128, 70, 90, 64] * 8, 128)}  # 32 x 128 = 4,096 rows
    erm = ERM(model, fast=True)
    assert step_module.static_row_counts(batch, erm) is None  # "auto": CUDA batches only
    monkeypatch.setattr(training_layer, "PACKED", True)
    n_real = int(batch["attention_mask"].sum())
    want = packing.bucket(n_real, 4096, training_layer.PACKED_MIN_PADDING)
    assert want is not None and step_module.static_row_counts(batch, erm) == want
    assert erm.packed_rows(batch, {}) is None and erm.narrowed_rows(batch, {}) is None  # `Objective`'s: the real rows
    assert step_module.static_row_counts(batch, ERM(model)) is None  # runs padded (`packing.padded`)
    cat = CAT(model)  # True packs CAT: the rows CMIX reads, for the plan's partners
    # the real rows up to the mixing layer and past it, the padding rows partners lend carried apart (none here)
    assert step_module.static_row_counts(batch, cat, {"partner": torch.arange(32)}) == (want, want, 0)
    lent = step_module.static_row_counts(batch, cat, {"partner": torch.arange(32).roll(1)})
    # 128 / 90 / 90 / 128 rows per four sequences (real: 128 / 70 / 90 / 64): 84 lent per four, 672, to 768 in
    # 256-row buckets; past the mixing layer, the real rows (mask_mode "self": the mixed sequences keep their own)
    assert lent == (want, want, 768)
    assert [packing.lent_bucket(n, 4096) for n in (0, 1, 256, 257)] == [0, 256, 256, 512]
    monkeypatch.setattr(packing, "LENT", False)  # the lent rows packed with the real ones up to the mixing layer
    assert step_module.static_row_counts(batch, cat, {"partner": torch.arange(32).roll(1)}) == (3584, want)
    assert step_module.static_row_counts(batch, cat, {"partner": torch.arange(32)}) == want  # its own partner: the real rows
    monkeypatch.setattr(packing, "LENT", True)
    assert not CAT(model, detach_weight=False).lent_rows_apart  # the lent rows take a gradient: packed with the rest
    assert step_module.static_row_counts(batch, CAT(model, detach_weight=False), {"partner": torch.arange(32).roll(1)}) == (
        3584, want)
    union = CAT(model, mask_mode="union")  # past the mixing layer, real | mixed: 128 / 128 / 90 / 90
    real = batch["attention_mask"] != 0
    rolled = {"partner": torch.arange(32).roll(1)}
    assert union.narrowed_rows(batch, rolled).sum(1)[:4].tolist() == [128, 128, 90, 90]
    assert union.narrowed_rows(batch, rolled).equal(real | real[rolled["partner"]])
    assert step_module.static_row_counts(batch, union, {"partner": torch.arange(32)}) == (want, want, 0)
    assert CAT(model, mask_mode="intersection").narrowed_rows(batch, {"partner": torch.arange(32)}).equal(
        batch["attention_mask"] != 0)
    left = {"attention_mask": batch["attention_mask"].flip(1)}
    assert step_module.static_row_counts(left, erm) is None
    # the count read from the batch's host mask (a batch the step moved: `_on_device`), the same buckets
    host = batch["attention_mask"].clone()
    assert step_module.static_row_counts(batch, erm, None, host) == want
    assert step_module.static_row_counts(left, erm, None, left["attention_mask"].clone()) is None
    assert step_module.static_row_counts(batch, erm, None, host[:8]) == want  # not the batch's shape: its own mask read
    assert step_module.static_row_counts(batch, cat, {"partner": torch.arange(32).roll(1)}, host) == lent  # CAT: its rows
    # with the plan's host copies (`StepPlan.host`) CAT's rows are counted from those, on the host
    assert step_module.static_row_counts(batch, cat, {"partner": torch.arange(32)}, host,
                                    {"partner": torch.arange(32).roll(1)}) == lent
    assert step_module.static_row_counts(batch, cat, {"partner": torch.arange(32).roll(1)}, None,
                                    {"partner": torch.arange(32)}) == lent  # no host mask: the device's rows
    assert step_module.static_row_counts(batch, erm, None, torch.ones_like(host)) is None  # the host mask is what counts
    cpu = {"attention_mask": host, "labels": torch.zeros(32)}
    assert step_module._on_device(cpu, torch.device("cpu")) == (cpu, None)  # moved to CUDA only
    monkeypatch.setattr(training_layer, "PACKED", False)
    assert step_module.static_row_counts(batch, erm) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_packs_cuda_batches_from_the_least_row_count():
    """"auto" on CUDA: a packing objective's batch packs from `PACKED_MIN_ROWS` rows, not below (CAT too with its
    lent rows carried apart; from 8,192 where they take a gradient); other objectives never."""
    from cat_fast import step as step_module
    from cat_fast.objectives import CAT

    model = tiny_model("bert", attn="sdpa", num_layers=2)
    erm = ERM(model, fast=True)
    big = {"attention_mask": _padding_mask([128, 70, 90, 64] * 8, 128).cuda()}
    small = {"attention_mask": _padding_mask([128, 70, 90, 64], 128).cuda()}
    assert step_module.static_row_counts(big, erm) is not None
    assert step_module.static_row_counts(small, erm) is None
    assert step_module.static_row_counts(big, ERM(model)) is None
    cat, partner = CAT(model), {"partner": torch.arange(32, device="cuda").roll(1)}
    # 4,096 rows: CAT packs its real rows (2,816), its lent ones apart (672, to 768 in 256-row buckets); with them
    # packed, it runs padded
    assert step_module.static_row_counts(big, cat, partner) == (2816, 2816, 768)
    assert step_module.static_row_counts(big, CAT(model, detach_weight=False), partner) is None
    assert step_module.static_row_counts(small, cat, partner) is None  # 1,024 rows
    large = {"attention_mask": _padding_mask([256, 100, 140, 64] * 8, 256).cuda()}  # 8,192 rows
    rows = step_module.static_row_counts(large, cat, {"partner": torch.arange(32, device="cuda").roll(1)})
    # real: 256 / 100 / 140 / 64 (4,480, to 4,608 in 256-row buckets) up to the mixing layer and past it; lent:
    # 256 / 140 / 140 / 256 rows per four sequences less the real ones (1,856, to 2,048 in 512-row buckets)
    assert rows == (4608, 4608, 2048)
    host = {"attention_mask": big["attention_mask"].cpu().pin_memory(), "labels": torch.zeros(32, dtype=torch.long)}
    moved, mask = step_module._on_device(host, torch.device("cuda"))
    assert mask is host["attention_mask"] and all(v.is_cuda for v in moved.values())
    assert torch.equal(moved["attention_mask"].cpu(), mask) and step_module.static_row_counts(moved, erm, None, mask) == (
        step_module.static_row_counts(big, erm))
    assert step_module._on_device(big, torch.device("cuda")) == (big, None)  # already there: as it is


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_graphs_hold_half_of_max_graphs_then_the_padded_graph_runs(monkeypatch):
    """With max_graphs=4, two row counts get packed graphs; a third row count of the same shape replays the padded
    graph instead of running eagerly. Eval mode: the losses of the padded captured step."""
    from cat_fast.step import CapturedStep

    a, b, c = [40, 17, 25, 9], [40, 30, 30, 20], [40, 10, 5, 5]
    # a's first call warms the batch shape up, b is captured at first sight, c's padded graph after an eager step
    lengths = [a, a, b, b, c, c, a, c]
    results = {}
    for packed in (False, True):
        monkeypatch.setattr(training_layer, "PACKED", packed)
        model = tiny_model("bert", attn="sdpa", num_layers=4, hidden_size=64, num_attention_heads=4,
                           intermediate_size=256, seed=0).cuda().eval()
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), capturable=True)
        step = CapturedStep(ERM(model, fast=True), opt, warmup_steps=1, max_graphs=4)
        losses = []
        for i, ls in enumerate(lengths):
            batch = tiny_batch("bert", batch=4, length=40, seed=i)
            batch["attention_mask"] = _padding_mask(ls, 40)
            losses.append(float(step({k: v.cuda() for k, v in batch.items()})[0]))
        results[packed] = losses, step.num_graphs, step.num_replays, len(step._packed_graphs)
    (losses, graphs, replays, packed_graphs), (want, want_graphs, _, _) = results[True], results[False]
    assert want_graphs == 1 and packed_graphs == 2 and graphs == 3 and replays == 6
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-4, atol=1e-5)


def test_a_packed_switch_of_another_value_is_refused(monkeypatch):
    """`PACKED` other than True, False or "auto" (a typo such as "on") raises naming the switch and the value, in the
    layer and in a captured step's signature, instead of being read as on."""
    from cat_fast import step as step_module

    monkeypatch.setattr(training_layer, "PACKED", "on")
    with pytest.raises(ValueError, match=r"PACKED: expected True, False or 'auto', got 'on'"):
        _run(_layer(), torch.randn(4, 9, D, dtype=torch.float64),
             models.inputs._padding_mask_4d(_padding_mask([9, 4, 6, 3], 9)), torch.zeros(4, 9, D, dtype=torch.float64),
             "on", monkeypatch)
    with pytest.raises(ValueError, match="PACKED"):
        step_module.static_row_counts({"attention_mask": _padding_mask([9, 4], 9)}, None)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [32, 6, 5])  # 16-byte rows (wide copies) for every dtype at 32; 6, 5: not all
def test_row_copies_equal_index_copy_and_index_fill(device, dtype, width):
    """`packing.copy_rows_`, `zero_rows` and `scatter`, which copy rows by 16-byte elements where the rows allow it,
    equal PyTorch's index_copy / index_fill; a strided `rows` and an unaligned `out` take PyTorch's own."""
    g = torch.Generator().manual_seed(width)
    full = torch.randn(40, width, generator=g).to(device, dtype)
    rows = torch.randn(9, width, generator=g).to(device, dtype)
    idx = torch.randperm(40, generator=g)[:9].to(device)
    want = full.index_copy(0, idx, rows)
    assert torch.equal(packing.copy_rows_(full.clone(), idx, rows), want)
    assert torch.equal(packing.scatter(full, idx, rows), want)
    assert torch.equal(packing.zero_rows(full, idx), full.index_fill(0, idx, 0))
    strided = torch.randn(9, 2 * width, generator=g).to(device, dtype)[:, ::2]
    assert torch.equal(packing.copy_rows_(full.clone(), idx, strided), full.index_copy(0, idx, strided))
    base = torch.randn(40 * width + 1, generator=g).to(device, dtype)
    unaligned = base[1:].view(40, width)  # one element past an aligned start
    want = unaligned.index_copy(0, idx, rows)
    assert packing._wide(unaligned) is None
    assert torch.equal(packing.copy_rows_(unaligned, idx, rows), want)
    assert packing.scatter(full.float(), idx, rows).dtype == dtype  # `full` taken in the rows' dtype
    wide = packing._wide(full)
    assert (wide is not None) == (width * full.element_size() % 16 == 0)


def test_a_captured_steps_signature_counted_without_running_it():
    """`CapturedStep.signature_of`: on the CPU a step runs padded ("auto"), and so does its signature; counted as a
    CUDA batch of 4,096 rows it keys its packed row count, with its padded signature to fall back to; below the
    least row count it runs padded there too; nothing is run (no gradient, the parameters untouched)."""
    from cat_fast.step import CapturedStep

    model = tiny_model("bert", attn="sdpa", num_layers=2)
    step = CapturedStep(ERM(model, fast=True), torch.optim.AdamW(model.parameters(), lr=1e-3))
    mask = _padding_mask([128, 70, 90, 64] * 8, 128)
    batch = {"input_ids": torch.ones(32, 128, dtype=torch.long), "attention_mask": mask,
             "labels": torch.zeros(32, dtype=torch.long)}
    before = [p.detach().clone() for p in model.parameters()]
    sig, padded, rows = step.signature_of(batch)
    assert padded is None and rows is None
    packed, fallback, rows = step.signature_of(batch, cuda_counts=True)
    assert fallback == sig and packed != sig
    want = packing.bucket(int(mask.sum()), 4096, training_layer.PACKED_MIN_PADDING)
    assert rows == want and ("rows", want) in packed[1]
    small = {k: v[:16] for k, v in batch.items()}  # 2,048 rows: below the least count
    assert step.signature_of(small, cuda_counts=True)[1] is None
    assert training_layer.PACKED == "auto" and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
