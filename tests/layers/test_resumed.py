"""cat_fast.resumed_layer: the Bert-layout layer of CAT's counterfactual passes against the model's own layer."""
import pytest
import torch

from cat_fast import models
from cat_fast.layers import resumed as resumed_layer
from cat_fast.objectives import CAT
from tests.conftest import assert_same_cat_steps, cat_steps_fast_and_own, tiny_batch, tiny_model

BERT_LAYOUTS = ("bert", "roberta", "electra")
CUDA = torch.cuda.is_available()


def _layer_and_mask(arch, batch=4, length=9, dtype=torch.float64, device="cpu", padded=True, **extra):
    model = tiny_model(arch, attn="sdpa", dtype=dtype, num_layers=2, hidden_dropout_prob=0.3,
                       attention_probs_dropout_prob=0.3, **extra).to(device)
    b = tiny_batch(arch, batch=batch, length=length, padded=padded)
    mask = models.inputs._padding_mask_4d(b["attention_mask"].to(device))
    return model, models.structure(model).layer_modules[1], mask


def _own(layer, x, mask):
    out = layer(x, mask)
    return out[0] if isinstance(out, tuple) else out


def _both(layer, x, mask, seed=3):
    """(own output, own input grad, resumed output, resumed input grad) from the same generator state."""
    results = []
    g = torch.randn(x.shape, dtype=x.dtype, device=x.device, generator=torch.Generator(x.device).manual_seed(9))
    for run in (lambda t: _own(layer, t, mask), lambda t: resumed_layer.forward(layer, (t, mask), {})):
        torch.manual_seed(seed)
        t = x.detach().requires_grad_(True)
        y = run(t)
        (grad,) = torch.autograd.grad(y, t, g)
        results += [y, grad]
    return results


@pytest.mark.parametrize("arch", BERT_LAYOUTS)
@pytest.mark.parametrize("train", [False, True])
def test_output_and_input_gradient_equal_the_layer(arch, train):
    model, layer, mask = _layer_and_mask(arch)
    layer.train(train)
    x = torch.randn(4, 9, 32, dtype=torch.float64)
    y_own, g_own, y, g = _both(layer, x, mask)
    assert not torch.equal(g_own, torch.zeros_like(g_own))
    # the same dropout draws (other draws would differ by O(0.1)); to float64 rounding: query, key and value are one
    # matmul here, three in the modules, and a CPU BLAS may sum a product of another width in another order
    torch.testing.assert_close(y, y_own, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, g_own, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["batch_of_one", "no_padding", "no_mask", "non_contiguous", "all_padding_row"])
def test_edge_cases(case):
    batch = 1 if case == "batch_of_one" else 4
    model, layer, mask = _layer_and_mask("bert", batch=batch, padded=case != "no_padding")
    layer.train()
    x = torch.randn(batch, 9, 32, dtype=torch.float64)
    if case == "no_mask":
        mask = None
    if case == "non_contiguous":
        x = torch.randn(batch, 32, 9, dtype=torch.float64).transpose(1, 2)
        assert not x.is_contiguous()
    if case == "all_padding_row":
        mask = mask.clone()
        mask[2] = False
    y_own, g_own, y, g = _both(layer, x, mask)
    torch.testing.assert_close(y, y_own, rtol=1e-12, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(g, g_own, rtol=1e-12, atol=1e-12, equal_nan=True)


def test_gradcheck_float64():
    model, layer, mask = _layer_and_mask("bert")
    layer.eval()
    x = torch.randn(3, 9, 32, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: resumed_layer.forward(layer, (t, mask[:3]), {}), (x,))


def test_no_parameter_gradients_and_no_double_backward():
    model, layer, mask = _layer_and_mask("bert")
    x = torch.randn(4, 9, 32, dtype=torch.float64, requires_grad=True)
    y = resumed_layer.forward(layer, (x, mask), {})
    weight = layer.attention.self.query.weight
    (grad,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):  # no parameter gradient (the promise of input_grad_only)...
        torch.autograd.grad(y.sum(), weight, retain_graph=True)
    with pytest.raises(RuntimeError):  # ...and no double backward
        torch.autograd.grad(grad.sum(), x)


def test_other_layers_and_calls_run_the_layer_itself():
    assert not resumed_layer.supported(models.structure(tiny_model("bert", attn="eager")).layer_modules[0])
    for arch, attn in (("distilbert", "sdpa"), ("albert", "sdpa"), ("deberta-v2", "eager")):
        assert not resumed_layer.supported(models.structure(tiny_model(arch, attn=attn)).layer_modules[0]), arch
    model, layer, mask = _layer_and_mask("bert")
    x = torch.randn(4, 9, 32, dtype=torch.float64)
    assert resumed_layer.supported(layer)
    assert resumed_layer.forward(layer, (x, mask, x), {}) is None  # cross-attention input
    assert resumed_layer.forward(layer, (x, mask), {"output_attentions": True}) is None
    assert resumed_layer.forward(layer, (x, mask[:, :, :, :5]), {}) is None  # a mask of another length


@pytest.mark.parametrize("arch", BERT_LAYOUTS)
def test_resume_with_input_grad_only_gives_the_same_logits_and_input_gradient(arch, monkeypatch):
    model = tiny_model(arch, attn="sdpa", dtype=torch.float64, num_layers=3, hidden_dropout_prob=0.3,
                       attention_probs_dropout_prob=0.3).train()
    batch = tiny_batch(arch, batch=5)
    cap = models.capture(model, batch, 1)
    h = cap.hidden.detach() + 0.1 * torch.randn_like(cap.hidden)
    taken = []
    original = resumed_layer.forward

    def spy(*args):
        out = original(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(resumed_layer, "forward", spy)
    results = []
    for fast in (False, True):
        x = h.clone().requires_grad_(True)
        logits = models.logits_of(models.resume(model, cap, x, input_grad_only=fast))
        (grad,) = torch.autograd.grad(logits.square().sum(), x)
        results.append((logits, grad))
    assert taken == [True, True]  # layers 2 and 3, only in the input_grad_only pass
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("prune", [True, False])
def test_cat_step_is_unchanged(prune, monkeypatch):
    # Train mode (dropout), float64, CAL steps on: the step's loss, info and parameter gradients with the resumed
    # layer equal those with the model's own layers.
    calls = []
    original = resumed_layer.forward
    monkeypatch.setattr(resumed_layer, "forward", lambda *a: calls.append(1) or original(*a))
    results = cat_steps_fast_and_own("fast_resume", prune, calls, "the resumed layer")
    assert all(info["lambda_after"] != info["lambda_before"] for _, info in results[0][0])
    assert_same_cat_steps(*results)


def _spy_fused(monkeypatch):
    calls = []
    original = resumed_layer._fused_forward
    monkeypatch.setattr(resumed_layer, "_fused_forward",
                        lambda *a: calls.append(a[4] is not None) or original(*a))
    return calls


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("arch", BERT_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_on_cuda_runs_the_fused_layer(arch, dtype, monkeypatch):
    # The same dropout draws: the output matches up to LayerNorm rounding (fp32 statistics computed in another
    # order), which flips the 16-bit rounding of a few feed-forward inputs. The input gradient is summed in fp32
    # (Hugging Face rounds each projection's input gradient to 16 bits first): it may differ by 16-bit rounding.
    model, layer, mask = _layer_and_mask(arch, batch=8, length=40, dtype=torch.float32, device="cuda")
    layer.train()
    x = torch.randn(8, 40, 32, device="cuda")
    calls = _spy_fused(monkeypatch)
    with torch.autocast("cuda", dtype=dtype, cache_enabled=False):
        y_own, g_own, y, g = _both(layer, x, mask)
        torch.manual_seed(3)
        with torch.no_grad():  # the final pass: no autograd, the same kernels
            y_no_grad = resumed_layer.forward(layer, (x, mask), {})
    assert calls == [True, False]
    assert y.dtype == y_own.dtype == torch.float32
    close = torch.isclose(y, y_own, rtol=1e-5, atol=1e-5)
    assert close.float().mean() > 0.99  # another dropout mask would move ~10 % of the outputs by O(1)
    assert (y - y_own).abs().max() <= 2e-2 * y_own.abs().max()
    torch.testing.assert_close(y_no_grad, y, rtol=0, atol=0)
    scale = g_own.abs().max()
    assert 0 < (g - g_own).abs().max() <= 2e-2 * scale
    # eval mode against float64: no worse than the layer's own
    layer.eval()
    with torch.autocast("cuda", dtype=dtype, cache_enabled=False):
        _, g_own, _, g = _both(layer, x, mask)
    _, g_ref, _, _ = _both(layer.double(), x.double(), mask)
    assert (g.double() - g_ref).abs().max() <= (g_own.double() - g_ref).abs().max() * 1.05 + 1e-6 * scale


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fused_and_composed_paths_agree_on_cuda():
    model, layer, mask = _layer_and_mask("bert", batch=3, length=17, dtype=torch.float32, device="cuda")
    layer.train()
    x = torch.randn(3, 17, 32, device="cuda")
    g = torch.randn_like(x)
    results = []
    for fused in (False, True):
        torch.manual_seed(4)
        t = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            if fused:
                y = resumed_layer._FusedLayer.apply(t, mask, layer, torch.bfloat16)
            else:
                y = resumed_layer._composed(layer, t, mask, torch.bfloat16)
        results.append((y, torch.autograd.grad(y, t, g)[0]))
    (y_c, g_c), (y_f, g_f) = results
    assert torch.isclose(y_f, y_c, rtol=1e-5, atol=1e-5).float().mean() > 0.99
    assert (y_f - y_c).abs().max() <= 2e-2 * y_c.abs().max()
    assert (g_f - g_c).abs().max() <= 2e-2 * g_c.abs().max()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("min_rows", [0, 4096], ids=["own_draws", "torch_draws"])
def test_a_resumed_fused_layer_redraws_the_training_layers_hidden_dropout(min_rows, monkeypatch):
    """Train mode, bf16 autocast, the same generator state: the resumed layer's fused path draws the hidden dropout
    masks the training layer drew for the same input, in the LayerNorm kernel where the training layer's fused path
    applies (`training.OWN_DROPOUT`, from `FUSED_MIN_ROWS` rows), `torch.native_dropout`'s elsewhere: the outputs
    agree to 16-bit rounding (other masks move ~30 % of them by O(1)), and the input gradients too."""
    from cat_fast.kernels.triton import residual_layer_norm
    from cat_fast.layers import training as training_layer

    monkeypatch.setattr(training_layer, "FUSED_MIN_ROWS", min_rows)
    drawn = []
    real = residual_layer_norm.forward_with_dropout
    monkeypatch.setattr(residual_layer_norm, "forward_with_dropout",
                        lambda *a, **k: drawn.append(a[7]) or real(*a, **k))
    model, layer, mask = _layer_and_mask("bert", batch=6, length=40, dtype=torch.float32, device="cuda")
    layer.train()  # hidden dropout 0.3
    x = torch.randn(6, 40, 32, device="cuda")
    g = torch.randn_like(x)
    results = []
    for run in (training_layer.forward, resumed_layer.forward, resumed_layer.forward):
        torch.manual_seed(4 if len(results) < 2 else 5)
        t = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            y = run(layer, (t, mask), {})
        results.append((y, torch.autograd.grad(y, t, g)[0]))
    assert drawn == ([0, 1] * 3 if min_rows == 0 else [])  # streams 0 and 1 of each layer's key
    (y_t, g_t), (y_r, g_r), (y_o, _) = results
    assert torch.isclose(y_r, y_t, rtol=1e-5, atol=1e-5).float().mean() > 0.99
    assert (y_r - y_t).abs().max() <= 2e-2 * y_t.abs().max()
    assert (g_r - g_t).abs().max() <= 2e-2 * g_t.abs().max()
    assert torch.isclose(y_o, y_t, rtol=1e-5, atol=1e-5).float().mean() < 0.95  # another state: other masks


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fused_layer_is_not_used_without_autocast_or_for_fp64(monkeypatch):
    model, layer, mask = _layer_and_mask("bert", batch=2, length=9, dtype=torch.float32, device="cuda")
    calls = _spy_fused(monkeypatch)
    x = torch.randn(2, 9, 32, device="cuda", requires_grad=True)
    y_own = _own(layer.eval(), x, mask)
    torch.testing.assert_close(resumed_layer.forward(layer, (x, mask), {}), y_own, rtol=1e-6, atol=1e-6)
    assert calls == []  # fp32 compute: the composed path


def _mask_neurons(module, args, output):
    out = output.clone()
    out[..., : out.shape[-1] // 2] = 0
    return out


def test_hooked_or_replaced_parts_run_the_layer_itself():
    # The resumed layer reads its parts' weights instead of calling them: a forward hook (e.g. neuron masking), a
    # global hook or a Linear subclass anywhere in the layer makes it step aside, so the hook sees its call.
    model, layer, mask = _layer_and_mask("bert")
    x = torch.randn(4, 9, 32, dtype=torch.float64)
    handle = layer.intermediate.dense.register_forward_hook(_mask_neurons)
    assert not resumed_layer.supported(layer) and resumed_layer.forward(layer, (x, mask), {}) is None
    handle.remove()
    assert resumed_layer.supported(layer)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: None)
    assert not resumed_layer.supported(layer)
    handle.remove()

    class Scaled(torch.nn.Linear):
        def forward(self, t):
            return 2 * super().forward(t)

    dense = layer.intermediate.dense
    dense.forward = lambda t: torch.nn.Linear.forward(dense, t)  # an instance-level forward (offloading wrappers)
    assert not resumed_layer.supported(layer)
    del dense.forward
    assert resumed_layer.supported(layer)

    scaled = Scaled(32, 32).double()
    scaled.load_state_dict(layer.attention.output.dense.state_dict())
    layer.attention.output.dense = scaled
    assert not resumed_layer.supported(layer)


def test_hugging_face_output_recorders_do_not_count_as_hooks():
    # Asking a model for hidden states or attentions once installs Hugging Face's recording hooks for good; they
    # record nothing in cat_fast's passes, so the resumed layer still runs.
    model, layer, mask = _layer_and_mask("bert")
    batch = tiny_batch("bert")
    model(**models.model_inputs(batch), output_attentions=True, output_hidden_states=True)
    if not any(m._forward_hooks for m in layer.modules()):
        pytest.skip("this transformers version installs no output recorders")
    assert resumed_layer.supported(layer)


def test_first_token_layer_runs_hooks_of_its_projections():
    # The first-token layer calls the layer's own projections (it reads no weights): a neuron-masking hook on the
    # keys acts on it as on the model's layer (eval mode: no dropout draws to compare).
    from cat_fast.layers import first_token as first_token_layer

    model, layer, mask = _layer_and_mask("bert")
    layer.eval()
    x = torch.randn(4, 9, 32, dtype=torch.float64)
    plain_row = first_token_layer.forward(layer, (x, mask), {})[:, 0]
    handle = layer.attention.self.key.register_forward_hook(_mask_neurons)
    try:
        row = first_token_layer.forward(layer, (x, mask), {})[:, 0]
        torch.testing.assert_close(row, _own(layer, x, mask)[:, 0], rtol=1e-12, atol=1e-12)
    finally:
        handle.remove()
    assert (row - plain_row).abs().max() > 1e-6  # the hook matters


def test_cat_step_honours_a_neuron_masking_hook():
    # A hook that masks neurons of an upper layer: the CAT step (train mode, CAL on) equals the one with the model's
    # own layers, which call the hooked module, and differs from the unhooked step.
    results = []
    for fast, hooked in ((True, True), (False, True), (True, False)):
        model = tiny_model("bert", attn="sdpa", dtype=torch.float64, num_layers=4, hidden_dropout_prob=0.3,
                           attention_probs_dropout_prob=0.3).train()
        if hooked:
            for layer in models.structure(model).layer_modules[2:]:
                layer.intermediate.dense.register_forward_hook(_mask_neurons)
        cat = CAT(model, layers=[1], adv_steps=2, adv_lr=0.5, generator=torch.Generator().manual_seed(5),
                  fast_resume=fast)
        torch.manual_seed(11)
        loss, info = cat(tiny_batch("bert", batch=5))
        results.append((loss.detach(), info["lambda_after"]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-10, atol=1e-12)
    assert (results[0][0] - results[2][0]).abs() > 1e-7  # the hook matters (1e-10 above is the agreement)
