"""cat_fast.layers.first_token's one-matmul keys and values for input-only passes (`INPUT_ONLY_KEY_VALUE`) against the
layer's own key and value modules: the same logits, input gradient and dropout draws; and the training row
(`TRAINING_ROW`) against the modules."""
import os

import pytest
import torch

from cat_fast import models
from cat_fast.layers import first_token
from cat_fast.objectives import CAT
from tests.conftest import tiny_batch, tiny_model

CUDA = torch.cuda.is_available()


def _count(monkeypatch):
    calls = []
    real = first_token._KeyValueFirst.apply
    monkeypatch.setattr(first_token._KeyValueFirst, "apply", lambda *a: calls.append(1) or real(*a))
    return calls


def _pass(model, cap, h, on, monkeypatch, seed=5):
    """(logits, input gradient) of an input-only counterfactual pass with the one-matmul keys and values on or off."""
    monkeypatch.setattr(first_token, "INPUT_ONLY_KEY_VALUE", on)
    h = h.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    logits = models.resume(model, cap, h, first_token=True, first_token_row_only=True, input_grad_only=True).logits
    (grad,) = torch.autograd.grad(logits.float().square().sum(), h)
    return logits, grad


@pytest.mark.parametrize("arch", ["bert", "roberta", "electra"])
@pytest.mark.parametrize("train", [False, True])
def test_same_logits_and_input_gradient_as_the_modules(arch, train, monkeypatch):
    model = tiny_model(arch, attn="sdpa", dtype=torch.float64, hidden_dropout_prob=0.3,
                       attention_probs_dropout_prob=0.3).train(train)
    cap = models.capture(model, tiny_batch(arch, batch=5), 1)
    assert models.first_token_ok(model, cap)
    calls = _count(monkeypatch)
    want = _pass(model, cap, cap.hidden, False, monkeypatch)
    assert calls == []
    got = _pass(model, cap, cap.hidden, True, monkeypatch)
    assert calls == [1]  # the last layer's keys and values in one matmul
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)  # the same dropout draws in train mode
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-12)


def test_other_layouts_hooks_and_passes_with_parameter_gradients_use_the_modules(monkeypatch):
    monkeypatch.setattr(first_token, "INPUT_ONLY_KEY_VALUE", True)
    calls = _count(monkeypatch)
    model = tiny_model("distilbert", attn="sdpa", dtype=torch.float64).eval()
    cap = models.capture(model, tiny_batch("distilbert"), 1)
    models.resume(model, cap, cap.hidden, first_token=True, input_grad_only=True)
    model = tiny_model("bert", attn="sdpa", dtype=torch.float64).eval()
    cap = models.capture(model, tiny_batch("bert"), 1)
    models.resume(model, cap, cap.hidden, first_token=True)  # parameter gradients may be taken: the modules
    assert calls == []
    seen = []
    key = models.structure(model).layer_modules[-1].attention.self.key
    handle = key.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape))
    try:
        models.resume(model, cap, cap.hidden, first_token=True, input_grad_only=True)
    finally:
        handle.remove()
    assert calls == [] and seen  # a hook on the key projection: it runs, on the modules' path
    models.resume(model, cap, cap.hidden, first_token=True, input_grad_only=True)
    assert calls == [1]


def test_under_cpu_autocast_the_input_gradient_is_summed_at_the_inputs_precision(monkeypatch):
    model = tiny_model("bert", attn="sdpa").eval()
    cap = models.capture(model, tiny_batch("bert", batch=5), 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _pass(model, cap, cap.hidden, False, monkeypatch)
        got = _pass(model, cap, cap.hidden, True, monkeypatch)
    assert got[1].dtype == want[1].dtype == torch.float32
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2e-2, atol=2e-2)
    assert (got[1] - want[1]).abs().max() <= 2e-2 * want[1].abs().max()


def test_cat_step_is_unchanged(monkeypatch):
    """CAT's CAL steps and final pass with the one-matmul keys and values: the same losses, λ and gradients in
    float64 with dropout on."""
    results = []
    calls = _count(monkeypatch)
    for on in (False, True):
        monkeypatch.setattr(first_token, "INPUT_ONLY_KEY_VALUE", on)
        model = tiny_model("bert", attn="sdpa", dtype=torch.float64, hidden_dropout_prob=0.3,
                           attention_probs_dropout_prob=0.3).train()
        cat = CAT(model, layers=[1], adv_steps=2, generator=torch.Generator().manual_seed(3))
        torch.manual_seed(0)
        erm, cf, info = cat.losses(tiny_batch("bert", batch=6))
        (erm + cf).backward()
        results.append((erm, cf, info["lambda_after"], [p.grad.clone() for p in model.parameters()
                                                        if p.grad is not None]))
    assert calls == [1, 1, 1]  # the two CAL steps and the final pass
    (e0, c0, l0, g0), (e1, c1, l1, g1) = results
    torch.testing.assert_close(e1, e0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(c1, c0, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(l1, l0, rtol=1e-10, atol=1e-12)
    assert len(g1) == len(g0)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_autocast_matches_the_modules_to_16_bit_rounding(monkeypatch):
    model = tiny_model("bert", attn="sdpa", hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3).cuda().train()
    cap = models.capture(model, {k: v.cuda() for k, v in tiny_batch("bert", batch=8, length=40).items()}, 1)
    calls = _count(monkeypatch)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = _pass(model, cap, cap.hidden, False, monkeypatch)
        got = _pass(model, cap, cap.hidden, True, monkeypatch)
    assert calls == [1]
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2e-2, atol=2e-2)
    assert (got[1] - want[1]).abs().max() <= 2e-2 * want[1].abs().max()


# ----------------------------------------------------------------------------- passes with parameter gradients

_ROW_KERNELS = ("residual_layer_norm", "gelu_bias_backward", "column_sums", "first_row_attention")


def _row_calls(monkeypatch, on_cpu=False):
    """The `_TrainingRow` calls; `on_cpu`: the row allowed on the CPU, its kernels under the Triton interpreter (the
    root conftest sets TRITON_INTERPRET=1 there), where the row otherwise never runs."""
    from cat_fast.ops.fused import fused_kernels

    calls = []
    real = first_token._TrainingRow.apply
    monkeypatch.setattr(first_token._TrainingRow, "apply", lambda *a: calls.append(1) or real(*a))
    if on_cpu:
        kernels = tuple(fused_kernels(name) for name in _ROW_KERNELS)
        if None in kernels:
            pytest.skip("needs Triton")
        monkeypatch.setattr(first_token, "_row_kernels", lambda x, dtype, layer_norm_dtype: kernels)
    return calls


def _training_pass(layer, x, mask, g, on, monkeypatch, seed=3, parameters=True):
    """(output [B, T, D], gradients of the input and, with `parameters`, of every parameter) of the first-token
    layer with the training row on or off."""
    monkeypatch.setattr(first_token, "TRAINING_ROW", on)
    torch.manual_seed(seed)
    t = x.detach().requires_grad_(True)
    out = first_token.forward(layer, (t, mask), {})
    assert out is not None and out.shape == x.shape
    return out, torch.autograd.grad(out, [t, *layer.parameters()] if parameters else [t], g)


def _first_token_layer(device="cpu", **config):
    model = tiny_model("bert", attn="sdpa", num_layers=2, **config).to(device)
    return models.structure(model).layer_modules[-1].train(True)


def _padded(lengths, T, D, device="cpu"):
    real = (torch.arange(T) < torch.tensor(lengths)[:, None]).to(device)
    mask = models.inputs._padding_mask_4d(real.long())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(lengths), T, D, generator=g).to(device)
    grad = torch.randn(len(lengths), T, D, generator=g).to(device)
    return x, mask, grad


INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs the row's kernels on the CPU under the Triton interpreter")


@INTERPRETED
@pytest.mark.parametrize("lengths", [[9, 4, 6, 3], [1], [9, 1, 9]], ids=["padded", "one_token", "full_rows"])
def test_training_row_equals_the_modules(lengths, monkeypatch):
    """The training row (its kernels under the interpreter, fp32) against the layer's own modules in train mode with
    hidden dropout (the same draws): row 0 and the input and every parameter gradient to fp32 rounding; rows 1.. the
    input's; an input-only backward (``autograd.grad`` of the input alone) gives the same input gradient."""
    layer = _first_token_layer(hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.0)
    x, mask, g = _padded(lengths, 9, layer.attention.self.all_head_size)
    calls = _row_calls(monkeypatch, on_cpu=True)
    want, want_grads = _training_pass(layer, x, mask, g, False, monkeypatch)
    assert calls == []
    got, grads = _training_pass(layer, x, mask, g, True, monkeypatch)
    assert calls == [1]
    torch.testing.assert_close(got[:, 0], want[:, 0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, 1:], x[:, 1:])
    names = ["input"] + [n for n, _ in layer.named_parameters()]
    assert len(grads) == len(want_grads) == len(names)
    for name, a, b in zip(names, grads, want_grads):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert (a - b).abs().max() <= 1e-5 * b.abs().max().clamp_min(1.0), name
    _, (grad_x,) = _training_pass(layer, x, mask, g, True, monkeypatch, parameters=False)
    assert calls == [1, 1]
    torch.testing.assert_close(grad_x, grads[0], rtol=1e-6, atol=1e-6)


def _input_only_pass(layer, x, mask, g, row, monkeypatch, seed=3):
    """(output [B, T, D], the input's gradient alone) of an input-only pass (CAT's counterfactual passes) with the
    training row on or off for such passes."""
    monkeypatch.setattr(first_token, "INPUT_ONLY_ROW", row)
    torch.manual_seed(seed)
    t = x.detach().requires_grad_(True)
    out = first_token.forward(layer, (t, mask), {}, input_only=True)
    assert out is not None and out.shape == x.shape
    return out, torch.autograd.grad(out, [t], g)[0]


@INTERPRETED
@pytest.mark.parametrize("lengths", [[9, 4, 6, 3], [1]], ids=["padded", "one_token"])
def test_input_only_passes_run_the_row_without_parameter_gradients(lengths, monkeypatch):
    """An input-only pass (its kernels under the interpreter, fp32, hidden dropout in train mode) runs the training
    row: row 0 and the input gradient equal the keys-and-values path's (the modules for the rest) to fp32 rounding,
    with no weight-gradient product; without gradients (CAT's final pass) the row runs too, with the same row 0."""
    from cat_fast.layers import training as training_layer

    layer = _first_token_layer(hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.0)
    x, mask, g = _padded(lengths, 9, layer.attention.self.all_head_size)
    calls = _row_calls(monkeypatch, on_cpu=True)
    products = []
    real = training_layer.weight_grad
    monkeypatch.setattr(training_layer, "weight_grad", lambda *a: products.append(1) or real(*a))
    want, want_grad = _input_only_pass(layer, x, mask, g, False, monkeypatch)
    assert calls == []
    got, grad = _input_only_pass(layer, x, mask, g, True, monkeypatch)
    assert calls == [1] and products == []
    torch.testing.assert_close(got[:, 0], want[:, 0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, 1:], x[:, 1:])
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-5)
    torch.manual_seed(3)
    with torch.no_grad():
        quiet = first_token.forward(layer, (x, mask), {}, input_only=True)
    assert calls == [1, 1]
    torch.testing.assert_close(quiet[:, 0], want[:, 0], rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(first_token, "INPUT_ONLY_ROW", 1)
    with pytest.raises(ValueError, match="INPUT_ONLY_ROW: expected True or False, got 1"):
        first_token.forward(layer, (x, mask), {}, input_only=True)


@INTERPRETED
def test_training_row_stays_off_where_it_does_not_apply(monkeypatch):
    """No gradient taken, an intervention or a hook on the layer, or (on the CPU, without the kernels allowed) any
    call: the layer's own modules run."""
    layer = _first_token_layer()
    x, mask, g = _padded([9, 4], 9, layer.attention.self.all_head_size)
    calls = _row_calls(monkeypatch)
    _training_pass(layer, x, mask, g, True, monkeypatch)  # the CPU: the kernels are CUDA's
    _row_calls(monkeypatch, on_cpu=True)
    with torch.no_grad():
        assert first_token.forward(layer, (x, mask), {}) is not None
    handle = layer.intermediate.dense.register_forward_hook(lambda *args: None)
    try:
        _training_pass(layer, x, mask, g, True, monkeypatch)
    finally:
        handle.remove()
    assert calls == []
    _training_pass(layer, x, mask, g, True, monkeypatch)
    assert calls == [1]


def _agree_in_fp32(layer, grads, want_grads, tol):
    """The input's and the layer's parameters' gradients (fp32) agree to `tol` of each one's largest value."""
    names = ["input"] + [n for n, _ in layer.named_parameters()]
    assert len(grads) <= len(names) and len(grads) == len(want_grads)
    for name, a, b in zip(names, grads, want_grads):
        assert a.dtype == b.dtype == torch.float32, name
        if not name.endswith("key.bias"):  # exactly 0 in exact arithmetic: rounding noise on both sides
            assert (a - b).abs().max() <= tol * b.abs().max().clamp_min(1e-6), name


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_training_row_matches_the_modules_to_16_bit_rounding(monkeypatch):
    """bf16 autocast on CUDA (the row's own conditions, from any row count), attention and hidden dropout in train
    mode: the same draws as the modules (the attention's keep mask as `attention.first_row` draws it), so row 0 and
    every gradient agree to bf16 rounding; another seed moves them."""
    from cat_fast.layers import training as training_layer

    monkeypatch.setattr(training_layer, "FUSED_MIN_ROWS", 0)
    layer = _first_token_layer("cuda", hidden_size=64, num_attention_heads=4, intermediate_size=256,
                               hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.2)
    x, mask, g = _padded([40, 17, 25, 9, 33, 40], 40, 64, "cuda")
    calls = _row_calls(monkeypatch)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want, want_grads = _training_pass(layer, x, mask, g, False, monkeypatch)
        got, grads = _training_pass(layer, x, mask, g, True, monkeypatch)
        other, _ = _training_pass(layer, x, mask, g, True, monkeypatch, seed=4)
    assert calls == [1, 1]
    torch.testing.assert_close(got[:, 0], want[:, 0], rtol=3e-2, atol=3e-2)
    _agree_in_fp32(layer, grads, want_grads, 3e-2)
    assert (other[:, 0] - want[:, 0]).abs().max() > 3e-2  # other draws: beyond the tolerance above


def test_training_row_switch_must_be_a_bool(monkeypatch):
    layer = _first_token_layer()
    x, mask, _ = _padded([9, 4], 9, layer.attention.self.all_head_size)
    monkeypatch.setattr(first_token, "TRAINING_ROW", "off")
    with pytest.raises(ValueError, match="TRAINING_ROW: expected True or False, got 'off'"):
        first_token.forward(layer, (x.requires_grad_(True), mask), {})


def _packed_pass(layer, x, mask, g, packed, monkeypatch, seed=3, input_only=False, row_only=False, fill=None):
    """(output, gradients of the input and, unless `input_only`, of every parameter) of the first-token layer on
    `x`'s rows, packed as the layer before hands them on (`packing.carry`) or padded, with the
    `attention.first_row_packed` calls."""
    from cat_fast.layers import attention, packing

    calls = []
    real = attention.first_row_packed
    monkeypatch.setattr(attention, "first_row_packed", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(seed)
    t = x.detach().requires_grad_(True)
    arg = t
    if packed:
        B, T, _ = x.shape
        plan = packing.plan(mask, B, T, 0.0)
        rows = packing.pack(t, plan)
        arg = packing.carry(rows, plan, t, packing.link(rows))
    out = first_token.forward(layer, (arg, mask), {}, fill, row_only, input_only)
    assert out is not None and out.shape == (x.shape[0], 1 if row_only else x.shape[1], x.shape[2])
    inputs = [t] if input_only else [t, *layer.parameters()]
    return out, torch.autograd.grad(out, inputs, g[:, :out.shape[1]]), calls


@pytest.mark.parametrize("path", ["modules", "input_only", "training_row"])
@pytest.mark.parametrize("lengths", [[9, 4, 6, 3], [1], [9, 1, 9]], ids=["padded", "one_token", "full_rows"])
def test_packed_rows_equal_the_padded_rows(path, lengths, monkeypatch):
    """The layer on the packed rows the layer before hands on (the modules, the one-matmul keys and values of an
    input-only pass, and the training row under the interpreter) against the same path on the padded rows, in
    train mode with attention and hidden dropout (the same draws): row 0, rows 1.. (the input's), and the input
    (zero on its padding rows) and every parameter gradient to fp32 rounding; the attention read the packed keys."""
    layer = _first_token_layer(hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3)
    x, mask, g = _padded(lengths, 9, layer.attention.self.all_head_size)
    monkeypatch.setattr(first_token, "TRAINING_ROW", path == "training_row")
    monkeypatch.setattr(first_token, "INPUT_ONLY_KEY_VALUE", path == "input_only")
    if path == "training_row":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("runs the row's kernels on the CPU under the Triton interpreter")
        row_calls = _row_calls(monkeypatch, on_cpu=True)
    kv_calls = _count(monkeypatch)
    io = path == "input_only"
    want, want_grads, _ = _packed_pass(layer, x, mask, g, False, monkeypatch, input_only=io)
    got, grads, calls = _packed_pass(layer, x, mask, g, True, monkeypatch, input_only=io)
    assert kv_calls == ([1, 1] if io else [])
    if path == "training_row":
        assert row_calls == [1, 1]
    else:
        assert calls == [1]  # the row's kernel reads the packed keys itself
    torch.testing.assert_close(got[:, 0], want[:, 0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, 1:], x[:, 1:])
    assert len(grads) == len(want_grads) == (1 if io else 1 + len(list(layer.parameters())))
    for a, b in zip(grads, want_grads):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert (a - b).abs().max() <= 1e-5 * b.abs().max().clamp_min(1.0)
    real = mask[:, 0, 0]  # True: a real key
    assert grads[0][~real].eq(0).all() and grads[0][real].ne(0).any()


def test_packed_rows_one_row_or_filled_and_unpacked_where_edited(monkeypatch):
    """``row_only`` hands the row alone, `fill` the constant in rows 1..; an intervention on the layer gets the
    rows unpacked and runs as on padded rows."""
    from cat_fast.layers import interventions

    layer = _first_token_layer()
    layer.eval()
    x, mask, g = _padded([9, 4, 6], 9, layer.attention.self.all_head_size)
    want, _, _ = _packed_pass(layer, x, mask, g, False, monkeypatch)
    got, _, _ = _packed_pass(layer, x, mask, g, True, monkeypatch, row_only=True)
    torch.testing.assert_close(got, want[:, :1], rtol=1e-6, atol=1e-6)
    got, _, _ = _packed_pass(layer, x, mask, g, True, monkeypatch, fill=2.5)
    torch.testing.assert_close(got[:, 0], want[:, 0], rtol=1e-6, atol=1e-6)
    assert got[:, 1:].eq(2.5).all()
    with interventions.intervene(layer, "value", lambda v: v * 0.5):
        want, want_grads, _ = _packed_pass(layer, x, mask, g, False, monkeypatch)
        got, grads, calls = _packed_pass(layer, x, mask, g, True, monkeypatch)
    assert calls == []  # unpacked: the padded path, with the edit
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("input_only,row", [(False, True), (True, True), (True, False)],
                         ids=["training_row", "input_only_row", "input_only_key_value"])
def test_cuda_packed_rows_equal_the_padded_rows_to_16_bit_rounding(input_only, row, monkeypatch):
    """bf16 autocast on CUDA with attention and hidden dropout: the training row (for an input-only pass too, or
    with `INPUT_ONLY_ROW` off its keys and values in one matmul) on packed rows, its attention by the packed
    first-row kernel, against the padded rows: the same draws, so row 0 and every gradient agree to bf16 rounding."""
    from cat_fast.layers import training as training_layer

    monkeypatch.setattr(training_layer, "FUSED_MIN_ROWS", 0)
    monkeypatch.setattr(first_token, "INPUT_ONLY_ROW", row)
    layer = _first_token_layer("cuda", hidden_size=64, num_attention_heads=4, intermediate_size=256,
                               hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.2)
    x, mask, g = _padded([40, 17, 25, 9, 33, 40, 1], 40, 64, "cuda")
    row_calls = _row_calls(monkeypatch)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want, want_grads, _ = _packed_pass(layer, x, mask, g, False, monkeypatch, input_only=input_only)
        got, grads, _ = _packed_pass(layer, x, mask, g, True, monkeypatch, input_only=input_only)
    assert row_calls == ([1, 1] if row else [])
    torch.testing.assert_close(got[:, 0], want[:, 0], rtol=2e-2, atol=2e-2)
    _agree_in_fp32(layer, grads, want_grads, 2e-2)
