"""Causal mediation analysis (cat_fast.analysis.mediation) against the one-forward-per-neuron reference."""
import pytest
import torch
import torch.nn.functional as F

from cat_fast import models
from cat_fast.analysis import mediation as M
from tests.conftest import tiny_batch, tiny_model

INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def _samples(arch, batch=6, length=9, seed=1):
    b = tiny_batch(arch, batch=batch, length=length, seed=seed)
    return {k: v for k, v in b.items() if k in INPUTS}


@pytest.mark.parametrize("arch", ["bert", "roberta", "distilbert", "electra"])
def test_batched_sweep_equals_one_forward_per_neuron(arch):
    """Every component of layers 1 and 3 (the last: first-token path), samples of different lengths cut into
    several length batches, the stacked passes into several chunks; the reference at 6 neurons per component
    (the first, the last and 4 at random)."""
    model = tiny_model(arch, dtype=torch.float64).eval()
    samples = _samples(arch)
    zbar = M.treatment_means(model, {k: v[:3] for k, v in samples.items()}, layers=[1, 3])
    fast = M.neuron_effects(model, samples, zbar, target_class=1, max_tokens=150, batch_tokens=30)
    g = torch.Generator().manual_seed(0)
    chosen = {k: [0, v.numel() - 1] + torch.randperm(v.numel(), generator=g)[:4].tolist() for k, v in zbar.items()}
    ref = M.neuron_effects_looped(model, samples, zbar, target_class=1, batch_size=4, neurons=chosen)
    assert set(fast.effects) == set(ref.effects) == {(layer, c) for layer in (1, 3) for c in models.COMPONENTS}
    for key, want in ref.effects.items():
        idx = torch.tensor(chosen[key])
        assert want[idx].abs().max() > 1e-12, key  # the interventions do something (tiny random models: ~1e-8)
        torch.testing.assert_close(fast.effects[key][idx], want[idx], rtol=1e-5, atol=1e-14,
                                   msg=lambda m: f"{key}: {m}")


def _far_zbar(model, samples, layers=None, scale=1.0, seed=0):
    """Treatment means moved by `scale`·N(0, 1) per neuron: effects of ~1e-2 instead of the ~1e-8 of a random tiny
    model's own means, so that an error in the sweep is far above float64 rounding."""
    zbar = M.treatment_means(model, {k: v[:3] for k, v in samples.items()}, layers=layers)
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in zbar.items()}


def _spy(monkeypatch):
    """Counts of fast-path chunks (`_fast_logits`) and stacked-path chunks (`_setter`) in `neuron_effects`."""
    calls = {"fast": 0, "stacked": 0}
    fast, setter = M._fast_logits, M._setter

    def fast_logits(*args, **kwargs):
        calls["fast"] += 1
        return fast(*args, **kwargs)

    def stacked(*args, **kwargs):
        calls["stacked"] += 1
        return setter(*args, **kwargs)

    monkeypatch.setattr(M, "_fast_logits", fast_logits)
    monkeypatch.setattr(M, "_setter", stacked)
    return calls


def _close(got, want, keys, idx=None, rtol=1e-6, atol=1e-12):
    for key in keys:
        i = torch.arange(want.effects[key].numel()) if idx is None else torch.tensor(idx[key])
        torch.testing.assert_close(got.effects[key][i], want.effects[key][i], rtol=rtol, atol=atol,
                                   msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("arch, attn, num_layers", [("bert", "eager", 3), ("distilbert", "sdpa", 3),
                                                    ("roberta", "sdpa", 4), ("distilbert", "eager", 4)])
def test_fast_sweep_equals_looped_reference_in_every_layer(arch, attn, num_layers, monkeypatch):
    """The fast path (row-0 work in layers ℓ and ℓ + 1) against the one-forward-per-neuron reference and the stacked
    path, for every component of every layer (the last, the second to last, and, with 4 layers, layers that resume
    the model after ℓ + 1): float64, padded length batches, several chunks per component."""
    model = tiny_model(arch, num_layers=num_layers, attn=attn, dtype=torch.float64).eval()
    samples = _samples(arch)
    assert samples["attention_mask"].sum(-1).unique().numel() > 2  # uneven lengths: padding inside batches
    zbar = _far_zbar(model, samples)
    calls = _spy(monkeypatch)
    fast = M.neuron_effects(model, samples, zbar, target_class=1, max_tokens=150, batch_tokens=30)
    assert calls["fast"] > 0 and calls["stacked"] == 0
    stacked = M.neuron_effects(model, samples, zbar, target_class=1, max_tokens=150, batch_tokens=30, fast=False)
    assert calls["stacked"] > 0
    g = torch.Generator().manual_seed(0)
    chosen = {k: [0, v.numel() - 1] + torch.randperm(v.numel(), generator=g)[:2].tolist() for k, v in zbar.items()}
    ref = M.neuron_effects_looped(model, samples, zbar, target_class=1, batch_size=4, neurons=chosen)
    keys = {(layer, c) for layer in range(1, num_layers + 1) for c in models.COMPONENTS}
    assert set(fast.effects) == set(ref.effects) == keys
    for key in keys:
        assert ref.effects[key][torch.tensor(chosen[key])].abs().max() > 1e-8, key  # query, key: ~1e-7
    _close(fast, ref, keys, chosen)
    _close(fast, stacked, keys)


@pytest.mark.parametrize("arch", ["bert", "distilbert"])
def test_fast_sweep_one_sample(arch, monkeypatch):
    """B = 1 (one sample, one copy per chunk as well as several)."""
    model = tiny_model(arch, dtype=torch.float64).eval()
    samples = {k: v[1:2] for k, v in _samples(arch).items()}
    zbar = _far_zbar(model, _samples(arch))
    calls = _spy(monkeypatch)
    chosen = {k: [0, 3, v.numel() - 1] for k, v in zbar.items()}
    ref = M.neuron_effects_looped(model, samples, zbar, target_class=2, neurons=chosen)
    for max_tokens in (1, 40):
        fast = M.neuron_effects(model, samples, zbar, target_class=2, max_tokens=max_tokens)
        _close(fast, ref, zbar, chosen)
    assert calls["stacked"] == 0 and calls["fast"] > 0


@pytest.mark.parametrize("arch", ["bert", "distilbert"])
def test_fast_sweep_when_the_head_reads_every_row(arch, monkeypatch):
    """With `first_token_ready` false (a head that reads more than row 0) the last layer runs for every row: the same
    effects as the reference, which does not depend on the decision."""
    model = tiny_model(arch, dtype=torch.float64).eval()
    samples = _samples(arch)
    zbar = _far_zbar(model, samples)
    monkeypatch.setattr(models, "first_token_ready", lambda model, batch: False)
    calls = _spy(monkeypatch)
    fast = M.neuron_effects(model, samples, zbar, max_tokens=100, batch_tokens=30)
    assert calls["stacked"] == 0
    chosen = {k: [1, v.numel() - 2] for k, v in zbar.items()}
    ref = M.neuron_effects_looped(model, samples, zbar, neurons=chosen)
    _close(fast, ref, zbar, chosen)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_fast_sweep_under_autocast(attn):
    """Under bf16 autocast (CPU) the fast path computes in the dtypes the modules would: it agrees with the stacked
    path to bf16 rounding (about 1e-4 here; the effects of the output components are ~1e-2)."""
    model = tiny_model("bert", attn=attn).eval()
    samples = _samples("bert")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        zbar = _far_zbar(model, samples, layers=[2, 3], scale=3.0)
        fast = M.neuron_effects(model, samples, zbar, max_tokens=150, batch_tokens=30)
        stacked = M.neuron_effects(model, samples, zbar, max_tokens=150, batch_tokens=30, fast=False)
    assert fast.effects[(3, "output")].abs().max() > 1e-3
    _close(fast, stacked, zbar, rtol=0, atol=5e-4)


def test_fast_path_falls_back_where_it_does_not_apply(monkeypatch):
    """A forward hook on a layer's part (it would not run on rows computed in pieces) or an intervention in effect
    sends the sweep to the stacked path, with the same effects."""
    model = tiny_model("bert", dtype=torch.float64).eval()
    samples = _samples("bert")
    zbar = _far_zbar(model, samples, layers=[2])
    want = M.neuron_effects(model, samples, zbar, fast=False)
    calls = _spy(monkeypatch)
    handle = model.bert.encoder.layer[2].intermediate.register_forward_hook(lambda mod, args, out: None)
    try:
        assert M._fast_ops(model) is None
        _close(M.neuron_effects(model, samples, zbar), want, zbar)
    finally:
        handle.remove()
    assert calls["stacked"] > 0 and calls["fast"] == 0
    with models.intervene(model, 1, "value", lambda x: x):
        assert M._fast_ops(model) is None
    assert M._fast_ops(model) is not None


def _padded_lengths(samples, batch_tokens):
    return [b["input_ids"].shape[1] for b in M.length_batches(samples, batch_tokens) for _ in b["input_ids"]]


def _matmul_counter(model, monkeypatch):
    """Patches F.linear and SDPA to count encoder-layer matmul FLOPs (attention: QKᵀ and AV) and rows per weight."""
    st = models.structure(model)
    encoder = {id(p) for layer in st.layer_modules for p in layer.parameters()}
    counts = {"flops": 0, "rows": {}}
    linear, sdpa = F.linear, F.scaled_dot_product_attention

    def counted_linear(x, weight, bias=None):
        if id(weight) in encoder:
            rows = x.numel() // x.shape[-1]
            counts["flops"] += 2 * rows * weight.shape[0] * weight.shape[1]
            counts["rows"][id(weight)] = counts["rows"].get(id(weight), 0) + rows
        return linear(x, weight, bias)

    def counted_sdpa(q, k, v, *args, **kwargs):
        counts["flops"] += 4 * (q.numel() // q.shape[-1]) * k.shape[-2] * q.shape[-1]
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "linear", counted_linear)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counted_sdpa)
    return counts


@pytest.mark.parametrize("arch", ["bert", "distilbert"])
@pytest.mark.parametrize("ready", [True, False])
def test_fast_sweep_skips_the_work_sweep_flops_counts(arch, ready, monkeypatch):
    """The encoder matmuls actually run (F.linear and SDPA counted) are `sweep_flops`' model exactly, for both
    paths; the fast path does fewer. Sweeping layer 1's query: the stacked path sends every token of every copy
    through layer 1's FFN and layer 2's query projection, the fast path row 0 of each copy only."""
    model = tiny_model(arch, num_layers=4, attn="sdpa").eval()
    samples = _samples(arch)
    zbar = M.treatment_means(model, samples)
    models.first_token_ready(model, samples)  # decided once per model (cached), before counting
    if not ready:
        monkeypatch.setattr(models, "first_token_ready", lambda model, batch: False)
    lengths = _padded_lengths(samples, 30)
    n, tokens = len(lengths), sum(lengths)
    layers = model.bert.encoder.layer if arch == "bert" else model.distilbert.transformer.layer
    ffn_in = (layers[0].intermediate.dense if arch == "bert" else layers[0].ffn.lin1).weight
    query2 = (layers[1].attention.self.query if arch == "bert" else layers[1].attention.q_lin).weight
    flops = {}
    for fast in (True, False):
        counts = _matmul_counter(model, monkeypatch)
        M.neuron_effects(model, samples, zbar, max_tokens=150, batch_tokens=30, fast=fast)
        flops[fast] = counts["flops"]
        assert flops[fast] == M.sweep_flops(model.config, lengths, first_token=ready, fast=fast)
        counts = _matmul_counter(model, monkeypatch)
        M.neuron_effects(model, samples, zbar, layers=[1], components=["query"], max_tokens=150, batch_tokens=30,
                         fast=fast)
        width = zbar[(1, "query")].numel()
        per_copy = n if fast else tokens  # rows per neuron beside the two clean forwards' 2 · tokens
        assert counts["rows"][id(ffn_in)] == 2 * tokens + width * per_copy
        assert counts["rows"][id(query2)] == 2 * tokens + width * per_copy
    assert flops[True] < 0.7 * flops[False]  # 0.56 (ready) and 0.62 here; less at real widths and lengths


def test_effects_are_the_formula_for_one_neuron():
    """NIE(n) = mean_u p_t(u | do(z_n = z̄_n)) / p_t(u) − 1, written out with a plain forward hook."""
    model = tiny_model("bert", dtype=torch.float64).eval()
    samples = _samples("bert", batch=5)
    zbar = M.treatment_means(model, {k: v[:2] for k, v in samples.items()}, components=["intermediate"], layers=[1])
    got = M.neuron_effects(model, samples, zbar, target_class=2)
    module = model.bert.encoder.layer[0].intermediate
    base = model(**samples).logits.softmax(-1)[:, 2]
    for neuron in (0, 17, 63):
        handle = module.register_forward_hook(
            lambda m, a, out: out.index_put((torch.arange(5), torch.zeros(5, dtype=torch.long),
                                             torch.full((5,), neuron)), zbar[(1, "intermediate")][neuron].double()))
        try:
            p = model(**samples).logits.softmax(-1)[:, 2]
        finally:
            handle.remove()
        want = (p / base).mean() - 1
        torch.testing.assert_close(got.effects[(1, "intermediate")][neuron].double(), want, rtol=1e-5, atol=1e-9)


def test_own_activation_gives_zero_effect():
    """With one sample as both treatment and sample, z̄ is its own activation: every NIE is 0."""
    model = tiny_model("bert", dtype=torch.float64).eval()
    one = {k: v[:1] for k, v in _samples("bert").items()}
    zbar = M.treatment_means(model, one)
    effects = M.neuron_effects(model, one, zbar)
    values, _ = effects.flat()
    assert values.numel() == 3 * (4 * 32 + 64 + 32)
    assert values.abs().max() < 1e-12


def test_padding_does_not_change_effects():
    """Extra padding columns (samples batched at their real lengths) leave the effects unchanged."""
    model = tiny_model("bert", dtype=torch.float64).eval()
    samples = _samples("bert")
    padded = {k: torch.cat([v, torch.zeros(v.shape[0], 7, dtype=v.dtype)], 1) for k, v in samples.items()}
    zbar = M.treatment_means(model, samples, layers=[3], components=["value"])
    a = M.neuron_effects(model, samples, zbar)
    b = M.neuron_effects(model, padded, zbar)
    torch.testing.assert_close(a.effects[(3, "value")], b.effects[(3, "value")], rtol=1e-6, atol=1e-12)


def test_attribution_is_the_first_order_term():
    """Attribution patching equals the exact NIE to first order: with z̄ moved a small step from the samples' own
    activations the two agree to second order; far away they differ (a test that can fail)."""
    model = tiny_model("bert", dtype=torch.float64).eval()
    samples = {k: v[:1] for k, v in _samples("bert").items()}
    own = M.treatment_means(model, samples, layers=[2])
    for scale, close in ((1e-4, True), (5.0, False)):
        g = torch.Generator().manual_seed(0)
        zbar = {k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in own.items()}
        exact = M.neuron_effects(model, samples, zbar)
        approx = M.attribution_effects(model, samples, zbar)
        e, _ = exact.flat()
        a, _ = approx.flat()
        assert e.abs().max() > 0
        if close:
            assert (e - a).abs().max() <= 1e-3 * e.abs().max()
        else:
            assert (e - a).abs().max() > 1e-2 * e.abs().max()


def test_attribution_with_frozen_weights():
    model = tiny_model("bert", dtype=torch.float64).eval().requires_grad_(False)
    samples = _samples("bert")
    zbar = M.treatment_means(model, samples, layers=[1])
    frozen = M.attribution_effects(model, samples, zbar, target_class=1)
    model.requires_grad_(True)
    live = M.attribution_effects(model, samples, zbar, target_class=1)
    for key in live.effects:
        torch.testing.assert_close(frozen.effects[key], live.effects[key])


def test_top_and_counts():
    effects = M.NeuronEffects({(1, "query"): torch.tensor([0.1, -0.5, 0.3]), (2, "output"): torch.tensor([0.2, 0.0])})
    assert effects.top(2) == [(1, "query", 2, pytest.approx(0.3)), (2, "output", 0, pytest.approx(0.2))]
    assert effects.top(1, by="abs")[0][:3] == (1, "query", 1)
    assert effects.counts(3) == {(1, "query"): 2, (2, "output"): 1}
    drawn = effects.random(3, seed=1)
    assert len(drawn) == 3 and len({d[:3] for d in drawn}) == 3 and drawn == effects.random(3, seed=1)
    assert sorted(d[:3] for d in effects.random(9, seed=0)) == sorted(t[:3] for t in effects.top(5))  # all 5
    assert {tuple(effects.random(2, seed=s)) for s in range(20)} != {tuple(drawn[:2])}


@pytest.mark.parametrize("kwargs, words", [
    (dict(components=["mlp"]), "components: expected names from"),
    (dict(layers=[4]), "layers: expected integers in [1, 3]"),
    (dict(target_class=3), "target_class: expected a label name or an index in [0, 3)"),
    (dict(target_class="entailment"), "target_class: 'entailment' is not a label of the model"),
])
def test_bad_arguments_name_themselves(kwargs, words):
    model = tiny_model("bert").eval()
    samples = _samples("bert")
    zbar = M.treatment_means(model, samples, layers=[1], components=["query"])
    with pytest.raises(ValueError, match=None) as caught:
        if "components" in kwargs or "layers" in kwargs:
            M.treatment_means(model, samples, **kwargs)
        else:
            M.neuron_effects(model, samples, zbar, **kwargs)
    assert words in str(caught.value)


def test_missing_treatment_means_and_bad_samples():
    model = tiny_model("bert").eval()
    samples = _samples("bert")
    zbar = M.treatment_means(model, samples, layers=[1], components=["query"])
    with pytest.raises(ValueError, match="zbar: no treatment means for layer 2 query"):
        M.neuron_effects(model, samples, zbar, layers=[2])
    with pytest.raises(ValueError, match="samples: expected a tokenised batch"):
        M.neuron_effects(model, {"input_ids": samples["input_ids"]}, zbar)


def test_resume_repeat_checks_its_arguments():
    model = tiny_model("bert").eval()
    batch = _samples("bert")
    cap = models.capture(model, batch, 1, rng=False)
    with pytest.raises(ValueError, match="repeat: expected an integer >= 1"):
        models.resume(model, cap, cap.hidden, repeat=0)
    with pytest.raises(ValueError, match="stacked 2 times"):
        models.resume(model, cap, cap.hidden, repeat=2)
    out = models.resume(model, cap, cap.hidden.repeat(2, 1, 1), repeat=2)
    full = model(**batch).logits
    torch.testing.assert_close(out.logits, full.repeat(2, 1), rtol=1e-5, atol=1e-6)
    model.train()
    with pytest.raises(ValueError, match="eval mode only"):
        models.resume(model, models.capture(model, batch, 1), cap.hidden.repeat(2, 1, 1), repeat=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_sweep_matches_the_looped_reference(precision):
    """On the GPU, in fp32 and under bf16 autocast: the batched sweep against the looped reference on the same
    samples (each computed in that precision), and the first-order estimate runs."""
    model = tiny_model("bert", num_layers=4).cuda().eval()
    samples = {k: v.cuda() for k, v in _samples("bert", batch=12, length=20).items()}
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
        zbar = M.treatment_means(model, {k: v[:4] for k, v in samples.items()})
        fast = M.neuron_effects(model, samples, zbar, max_tokens=2000, batch_tokens=120)
        chosen = {k: [0, 7, v.numel() - 1] for k, v in zbar.items()}
        ref = M.neuron_effects_looped(model, samples, zbar, neurons=chosen)
        M.attribution_effects(model, samples, zbar)
    tol = dict(rtol=1e-4, atol=1e-7) if precision == "fp32" else dict(rtol=5e-2, atol=2e-3)
    for key, idx in chosen.items():
        torch.testing.assert_close(fast.effects[key][idx], ref.effects[key][idx], **tol, msg=lambda m: f"{key}: {m}")
