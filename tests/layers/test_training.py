"""cat_fast.training_layer: the Bert-layout layer as one autograd node, against the model's own layer (output,
input gradient and every parameter gradient), on the CPU and on CUDA; its use in the training forwards of `models`, GS
and CAT: tests/layers/test_training_objectives.py."""
import pytest
import torch
import torch.nn.utils.parametrize  # noqa: F401 - torch.nn.utils.parametrize below

from cat_fast import models
from cat_fast.layers import training as training_layer
from tests.conftest import tiny_batch, tiny_model

BERT_LAYOUTS = ("bert", "roberta", "electra")
CUDA = torch.cuda.is_available()


def _layer_and_mask(arch="bert", batch=4, length=9, dtype=torch.float64, device="cpu", padded=True, **extra):
    model = tiny_model(arch, attn="sdpa", dtype=dtype, num_layers=2, hidden_dropout_prob=0.3,
                       attention_probs_dropout_prob=0.3, **extra).to(device)
    b = tiny_batch(arch, batch=batch, length=length, padded=padded)
    mask = models.inputs._padding_mask_4d(b["attention_mask"].to(device))
    return model, models.structure(model).layer_modules[1], mask


def _output(out):
    return out[0] if isinstance(out, tuple) else out


def _both(layer, x, mask, seed=3, autocast=False):
    """For the layer itself and for `training_layer`, from the same generator state: (output, gradients of the
    input and of every parameter that requires one, in `layer.parameters()` order)."""
    results = []
    g = torch.randn(x.shape, dtype=torch.float32 if autocast else x.dtype, device=x.device,
                    generator=torch.Generator(x.device).manual_seed(9))
    for run in (lambda t: _output(layer(t, mask)), lambda t: training_layer.forward(layer, (t, mask), {})):
        torch.manual_seed(seed)
        t = x.detach().requires_grad_(x.requires_grad)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            y = run(t)
        assert y is not None
        wrt = ([t] if t.requires_grad else []) + [p for p in layer.parameters() if p.requires_grad]
        results.append((y, torch.autograd.grad(y, wrt, g.to(y.dtype))))
    return results


def _assert_same(results, rtol=1e-12, atol=1e-12):
    (y_own, g_own), (y, g) = results
    torch.testing.assert_close(y, y_own, rtol=rtol, atol=atol, equal_nan=True)
    assert len(g) == len(g_own)
    for a, b in zip(g, g_own):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("arch", BERT_LAYOUTS)
@pytest.mark.parametrize("train", [False, True])
def test_output_and_all_gradients_equal_the_layer(arch, train):
    _, layer, mask = _layer_and_mask(arch)
    layer.train(train)
    x = torch.randn(4, 9, 32, dtype=torch.float64, requires_grad=True)
    results = _both(layer, x, mask)
    assert all(not torch.equal(gr, torch.zeros_like(gr)) for gr in results[0][1])
    _assert_same(results)


def test_dropout_draws_are_the_layers():
    """A different seed gives other masks, so the agreement above is not that of two dropout-free passes."""
    _, layer, mask = _layer_and_mask()
    layer.train()
    x = torch.randn(4, 9, 32, dtype=torch.float64, requires_grad=True)
    (y_own, _), _ = _both(layer, x, mask, seed=3)
    _, (y_other, _) = _both(layer, x, mask, seed=4)
    assert (y_own - y_other).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["batch_of_one", "no_padding", "no_mask", "non_contiguous", "all_padding_row",
                                  "odd_length"])
def test_edge_cases(case):
    batch = 1 if case == "batch_of_one" else 4
    length = 7 if case == "odd_length" else 9
    _, layer, mask = _layer_and_mask(batch=batch, length=length, padded=case != "no_padding")
    layer.train()
    x = torch.randn(batch, length, 32, dtype=torch.float64)
    if case == "no_mask":
        mask = None
    if case == "non_contiguous":
        x = torch.randn(batch, 32, length, dtype=torch.float64).transpose(1, 2)
        assert not x.is_contiguous()
    if case == "all_padding_row":
        mask = mask.clone()
        mask[2] = False
    _assert_same(_both(layer, x.requires_grad_(True), mask))


def test_frozen_parameters_and_an_input_without_gradient():
    _, layer, mask = _layer_and_mask()
    layer.train()
    frozen = [layer.attention.self.key.weight, layer.attention.output.LayerNorm.bias, layer.output.dense.bias]
    for p in frozen:
        p.requires_grad_(False)
    x = torch.randn(4, 9, 32, dtype=torch.float64)  # no gradient for the input
    _assert_same(_both(layer, x, mask))
    y = training_layer.forward(layer, (x, mask), {})
    y.sum().backward()
    assert all(p.grad is None for p in frozen)
    assert layer.attention.self.query.weight.grad is not None


def test_gradcheck_float64():
    """Input and parameter gradients against finite differences (gradcheck perturbs the parameters in place, and
    the layer reads them from its modules)."""
    _, layer, mask = _layer_and_mask()
    layer.eval()
    x = torch.randn(2, 5, 32, dtype=torch.float64, requires_grad=True)
    params = (layer.attention.self.query.weight, layer.attention.self.value.bias, layer.attention.output.dense.weight,
              layer.attention.output.LayerNorm.weight, layer.intermediate.dense.weight, layer.output.LayerNorm.bias)
    mask = mask[:2, :, :5, :5]
    assert torch.autograd.gradcheck(lambda t, *_: training_layer.forward(layer, (t, mask), {}), (x, *params))


def test_a_retained_graph_runs_its_backward_again():
    _, layer, mask = _layer_and_mask()
    layer.train()
    x = torch.randn(4, 9, 32, dtype=torch.float64, requires_grad=True)
    y = training_layer.forward(layer, (x, mask), {})
    first = torch.autograd.grad(y.sum(), (x, layer.intermediate.dense.weight), retain_graph=True)
    second = torch.autograd.grad(y.sum(), (x, layer.intermediate.dense.weight))
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_input_only_backward_skips_the_weight_gradients(monkeypatch):
    """torch.autograd.grad w.r.t. the input (GS's g) computes no parameter gradient; w.r.t. one parameter, that
    one; the values are those of the full backward."""
    _, layer, mask = _layer_and_mask()
    layer.train()
    x = torch.randn(4, 9, 32, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(3)
    y = training_layer.forward(layer, (x, mask), {})
    g = torch.randn_like(y)
    w = layer.intermediate.dense.weight
    full = torch.autograd.grad(y, (x, w), g, retain_graph=True)
    products = []
    original = training_layer.weight_grad
    monkeypatch.setattr(training_layer, "weight_grad", lambda *a: products.append(a[0].shape) or original(*a))
    (only_x,) = torch.autograd.grad(y, x, g, retain_graph=True)
    assert products == []
    (only_w,) = torch.autograd.grad(y, w, g)
    assert len(products) == 1
    torch.testing.assert_close(only_x, full[0], rtol=0, atol=0)
    torch.testing.assert_close(only_w, full[1], rtol=0, atol=0)


def test_calls_and_layers_it_does_not_take_return_none():
    model, layer, mask = _layer_and_mask()
    x = torch.randn(4, 9, 32, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        assert training_layer.forward(layer, (x, mask), {}) is None  # no autograd: nothing to gain
    assert training_layer.forward(layer, (x.detach(), mask), {}) is not None  # parameters still need gradients
    assert training_layer.forward(layer, (x, mask), {"encoder_hidden_states": x}) is None
    handle = layer.output.dense.register_forward_hook(lambda *a: None)
    assert not training_layer.supported(layer)
    handle.remove()
    assert training_layer.supported(layer)
    eager_model = tiny_model("bert", attn="eager", dtype=torch.float64, num_layers=2)
    assert not training_layer.supported(models.structure(eager_model).layer_modules[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast over a float64 layer: the layer's own rules
        assert training_layer.forward(layer, (x, mask), {}) is None
    assert training_layer.forward(layer, (x.float(), mask), {}) is None  # input and parameters of two dtypes
    distil = tiny_model("distilbert", attn="sdpa", dtype=torch.float64, num_layers=2)
    assert not training_layer.supported(models.structure(distil).layer_modules[0])


def test_a_part_replaced_or_parametrized_after_a_call_runs_the_layer_itself():
    """The full check is remembered per layer only while its submodules and their types stay the same."""
    _, layer, mask = _layer_and_mask()
    x = torch.randn(4, 9, 32, dtype=torch.float64, requires_grad=True)
    assert training_layer.forward(layer, (x, mask), {}) is not None

    class Adapter(torch.nn.Linear):  # an adapter wrapping the projection: its forward is not the weights'
        pass

    dense = layer.output.dense
    layer.output.dense = Adapter(32, 32, dtype=torch.float64)
    assert training_layer.forward(layer, (x, mask), {}) is None
    layer.output.dense = dense
    assert training_layer.forward(layer, (x, mask), {}) is not None
    torch.nn.utils.parametrize.register_parametrization(dense, "weight", torch.nn.Identity())
    assert training_layer.forward(layer, (x, mask), {}) is None


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("arch", BERT_LAYOUTS)
@pytest.mark.parametrize("train", [False, True])
def test_autocast_bf16_on_cuda_agrees_to_16_bit_rounding(arch, train):
    torch.manual_seed(0)
    _, layer, mask = _layer_and_mask(arch, batch=6, length=40, dtype=torch.float32, device="cuda", hidden_size=64,
                                     num_attention_heads=4, intermediate_size=256)
    layer.train(train)
    x = torch.randn(6, 40, 64, device="cuda", requires_grad=True)
    (y_own, g_own), (y, g) = _both(layer, x, mask, autocast=True)
    assert y.dtype == y_own.dtype == torch.float32
    torch.testing.assert_close(y, y_own, rtol=2e-2, atol=2e-2)  # the same dropout masks, else O(1) differences
    names = ["input"] + [n for n, _ in layer.named_parameters()]
    grads = dict(zip(names, g))
    for name, a, b in zip(names, g, g_own):
        assert a.dtype == b.dtype and a.shape == b.shape
        if name.endswith("key.bias"):
            # exactly 0 (softmax ignores a shift shared by all keys): both are rounding noise, small beside the
            # value bias's gradient
            assert max(a.abs().max(), b.abs().max()) < 1e-2 * grads[name.replace("key", "value")].abs().max()
            continue
        scale = b.abs().max().clamp_min(1e-6)
        assert (a - b).abs().max() / scale < 3e-2, name


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", ["bf16_model", "fp16_autocast"])
def test_16_bit_model_and_fp16_autocast_on_cuda(case):
    dtype = torch.bfloat16 if case == "bf16_model" else torch.float32
    _, layer, mask = _layer_and_mask(batch=5, length=24, dtype=dtype, device="cuda")
    layer.train()
    x = torch.randn(5, 24, 32, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(5, 24, 32, device="cuda")
    results = []
    for run in (lambda t: _output(layer(t, mask)), lambda t: training_layer.forward(layer, (t, mask), {})):
        torch.manual_seed(3)
        t = x.detach().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=case == "fp16_autocast"):
            y = run(t)
        assert y is not None
        wrt = [t, layer.intermediate.dense.weight, layer.output.LayerNorm.weight, layer.attention.self.query.bias]
        results.append((y, torch.autograd.grad(y, wrt, g.to(y.dtype))))
    (y_own, g_own), (y, grads) = results
    assert y.dtype == y_own.dtype
    torch.testing.assert_close(y, y_own, rtol=3e-2, atol=3e-2)
    for a, b in zip(grads, g_own):
        assert a.dtype == b.dtype
        assert (a - b).abs().max() / b.abs().max().clamp_min(1e-6) < 5e-2


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fp32_on_cuda_agrees_closely():
    _, layer, mask = _layer_and_mask(batch=3, length=33, dtype=torch.float32, device="cuda")
    layer.train()
    x = torch.randn(3, 33, 32, device="cuda", requires_grad=True)
    _assert_same(_both(layer, x, mask), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_what_the_backward_needs_is_freed_when_it_has_run():
    """A training loop keeps its last loss (and so the graph) alive into the next step: the saved activations must
    go with the backward, as the layer's own do."""
    _, layer, mask = _layer_and_mask(batch=8, length=64, dtype=torch.float32, device="cuda")
    layer.train()
    kept = {}
    for name, run in (("own", lambda t: _output(layer(t, mask))),
                      ("training", lambda t: training_layer.forward(layer, (t, mask), {}))):
        x = torch.randn(8, 64, 32, device="cuda", requires_grad=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        y = run(x)
        during = torch.cuda.memory_allocated() - base
        y.sum().backward()
        x.grad = None
        layer.zero_grad(set_to_none=True)
        kept[name] = (during, torch.cuda.memory_allocated() - base)
        del y
    assert kept["training"][0] > 4 * kept["training"][1]  # something was saved, and freed
    assert kept["training"][1] <= kept["own"][1]


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("train,own", [(False, True), (True, False), (True, True)],
                         ids=["eval", "train_torch_draws", "train_own_draws"])
@pytest.mark.parametrize("input_only", [False, True])
def test_fused_kernels_run_under_autocast_and_agree_with_the_unfused_path(train, own, input_only, monkeypatch):
    """bf16 autocast on CUDA: the Triton kernels run (counted), with the dropout draws of the unfused path (the same
    output and gradients to 16-bit rounding; a different mask would differ by O(1)): `torch.native_dropout`'s with
    ``OWN_DROPOUT = False``, else the masks the LayerNorm kernel drew, replayed by the unfused path; an input-only
    backward (GS's ``g``) uses the input-only kernel and leaves the parameters' gradients alone."""
    from cat_fast.kernels.triton import gelu_bias_backward, residual_layer_norm
    _, layer, mask = _layer_and_mask(batch=5, length=37, dtype=torch.float32, device="cuda", hidden_size=96,
                                     num_attention_heads=4, intermediate_size=200)
    layer.train(train)
    monkeypatch.setattr(training_layer, "OWN_DROPOUT", own)
    calls, drawn = [], []
    for module, names in ((residual_layer_norm, ("forward", "forward_with_dropout", "backward",
                                                 "backward_with_params")),
                          (gelu_bias_backward, ("backward",))):
        for name in names:
            def counted(*a, _f=getattr(module, name), _n=f"{module.__name__.rsplit('.', 1)[1]}.{name}", **k):
                calls.append(_n)
                out = _f(*a, **k)
                if _n.endswith("forward_with_dropout"):
                    drawn.append(out[4])
                return out
            monkeypatch.setattr(module, name, counted)

    def replayed(x, p):  # the unfused path with the fused run's masks, written as torch.native_dropout writes them
        if p == 0.0:
            return x, None
        keep = masks.pop(0).view(x.shape)
        return torch.where(keep, (x.float() * (1.0 / (1.0 - p))).to(x.dtype), 0).to(x.dtype), keep

    x = torch.randn(5, 37, 96, device="cuda", requires_grad=True)
    g = torch.randn(5, 37, 96, device="cuda")
    results = {}
    monkeypatch.setattr(training_layer, "FUSED_MIN_ROWS", 0)  # 185 rows: fused at any size here
    for fused in (True, False):
        monkeypatch.setattr(training_layer, "FUSED", fused)
        if not fused and train and own:
            masks = list(drawn)
            monkeypatch.setattr(training_layer, "dropout", replayed)
        calls.clear()
        torch.manual_seed(4)
        t = x.detach().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = training_layer.forward(layer, (t, mask), {})
        wrt = [t] if input_only else [t, *layer.parameters()]
        results[fused] = (y, torch.autograd.grad(y, wrt, g))
        if fused:
            rln = "residual_layer_norm."
            forward = rln + ("forward_with_dropout" if train and own else "forward")
            want = [forward] * 2 + ([rln + "backward"] * 2 if input_only else
                                    [rln + "backward_with_params", "gelu_bias_backward.backward",
                                     rln + "backward_with_params"])
            if input_only:
                want.insert(3, "gelu_bias_backward.backward")
            assert calls == want
        else:
            assert calls == []
    if train and own:
        assert len(drawn) == 2 and not masks  # both masks drawn by the kernel and replayed
        p = layer.output.dropout.p
        for keep in drawn:  # 17,760 draws each: a standard deviation of 0.0034 at p = 0.3
            assert keep.shape == (5 * 37, 96) and abs(keep.float().mean() - (1 - p)) < 0.02
        assert not torch.equal(drawn[0], drawn[1])
    (y, grads), (y_ref, g_ref) = results[True], results[False]
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
    names = ["input"] + ([] if input_only else [n for n, _ in layer.named_parameters()])
    for name, a, b in zip(names, grads, g_ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if name.endswith("key.bias"):  # exactly 0 in exact arithmetic: rounding noise on both sides
            continue
        assert (a - b).abs().max() / b.abs().max().clamp_min(1e-6) < 2e-2, name


def test_fusion_applies_only_to_an_fp32_cuda_layer_under_16_bit_autocast(monkeypatch):
    x = torch.randn(32, 32, 3)  # 1,024 rows: the threshold
    assert training_layer.FUSED_MIN_ROWS == 1024
    assert training_layer.fusion(x, torch.bfloat16, torch.float32) is None  # CPU
    if CUDA:
        xc = x.cuda()
        assert training_layer.fusion(xc, torch.bfloat16, torch.float32) is not None
        assert training_layer.fusion(xc[:, :31], torch.bfloat16, torch.float32) is None  # 992 rows
        assert training_layer.fusion(xc, torch.float32, torch.float32) is None
        assert training_layer.fusion(xc.half(), torch.float16, torch.float16) is None
        monkeypatch.setattr(training_layer, "FUSED", False)
        assert training_layer.fusion(xc, torch.bfloat16, torch.float32) is None
