"""cat_fast.layers.double_layers: LayerNorm and GELU with a fused double backward, and `installed`. The kernels (on
the CPU under the Triton interpreter) and their PyTorch composition against autograd's own double backward of
``F.layer_norm`` / ``F.gelu`` in float64: the output, the gradients and the gradients of a random combination of the
gradients, with respect to x, the weight, the bias and the output gradient; several rows per program, one row,
constant rows, multi-dimensional normalized shapes, non-contiguous inputs, each cotangent alone; gradcheck and
gradgradcheck; autocast; the errors; `installed` on Hugging Face models; exact GS at a layer on the fused layers
against eager layers; on CUDA, fp32 / bf16 against float64."""
import os

import pytest
import torch
import torch.nn.functional as F

from cat_fast.layers import double_layers as dl
from cat_fast.ops import fused

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
RUNS = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
needs_kernel = pytest.mark.skipif(not RUNS or dl._kernels() is None, reason="needs CUDA or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _all_orders(fn, inputs, cotangents=None, seed=3):
    """(output, first gradients, second gradients) of ``fn(*inputs)``: the gradients for a random output gradient
    go (create_graph), then those of a random combination of them (or `cotangents`, None entries skipped) with
    respect to the inputs and go."""
    g = torch.Generator().manual_seed(seed)
    out = fn(*inputs)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out).requires_grad_(True)
    first = torch.autograd.grad(out, inputs, go, create_graph=True)
    if cotangents is None:
        cotangents = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(t) for t in first]
    total = sum((x * c).sum() for x, c in zip(first, cotangents) if c is not None)
    second = torch.autograd.grad(total, (*inputs, go), allow_unused=True)
    return out, first, [torch.zeros_like(t) if s is None else s for s, t in zip(second, (*inputs, go))]


def _assert_same(got, want, atol=1e-10, rtol=1e-9):
    for a, b in zip(got, want):
        if isinstance(a, (list, tuple)):
            _assert_same(a, b, atol, rtol)
        else:
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def _layer_norm_inputs(shape, normalized, seed=0, device=DEVICE, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=dtype)
    w = torch.randn(normalized, generator=g, dtype=dtype)
    b = torch.randn(normalized, generator=g, dtype=dtype)
    return [t.to(device) for t in (x, w, b)]


def _compare_layer_norm(x, w, b, normalized, cotangents=None, eps=1e-5):
    got = _all_orders(lambda x, w, b: dl.layer_norm(x, normalized, w, b, eps), _leaves(x, w, b), cotangents)
    shape = (normalized,) if isinstance(normalized, int) else normalized
    want = _all_orders(lambda x, w, b: F.layer_norm(x, shape, w, b, eps), _leaves(x, w, b), cotangents)
    _assert_same(got, want)
    assert any(float(t.abs().max()) > 0 for t in got[2])
    return got


@needs_kernel
@pytest.mark.parametrize("shape", [(3, 5, 37), (1, 1, 768), (70, 19), (2, 3, 1030)])
def test_layer_norm_all_orders_equal_autograd_in_float64(shape):
    x, w, b = _layer_norm_inputs(shape, shape[-1])
    _compare_layer_norm(x, w, b, shape[-1])


@needs_kernel
def test_layer_norm_constant_rows_multi_dim_shapes_and_strided_inputs():
    x, w, b = _layer_norm_inputs((4, 9, 2, 6), (2, 6))
    x[1, 3] = 0.7  # a constant row: x_hat = 0, rstd = eps ** -0.5
    _compare_layer_norm(x, w, b, (2, 6), eps=1e-3)
    wide, w, b = _layer_norm_inputs((6, 40), 11)
    strided = wide[:, ::3][:, :11]
    assert not strided.is_contiguous()
    _compare_layer_norm(strided, w, b, 11)


@needs_kernel
@pytest.mark.parametrize("which", [0, 1, 2])
def test_layer_norm_each_cotangent_alone(which):
    x, w, b = _layer_norm_inputs((5, 23), 23, seed=which)
    g = torch.Generator().manual_seed(9)
    cot = [None, None, None]
    cot[which] = torch.randn((5, 23) if which == 0 else (23,), generator=g, dtype=torch.float64).to(DEVICE)
    _compare_layer_norm(x, w, b, 23, cotangents=cot)


@needs_kernel
@pytest.mark.parametrize("n", [1, 1030, 3 * 1024])
def test_gelu_all_orders_equal_autograd_in_float64(n):
    g = torch.Generator().manual_seed(n)
    x = (3 * torch.randn(n, generator=g, dtype=torch.float64)).to(DEVICE)
    got = _all_orders(dl.gelu, _leaves(x))
    want = _all_orders(F.gelu, _leaves(x))
    _assert_same(got, want)
    strided = (3 * torch.randn(7, 20, generator=g, dtype=torch.float64)).to(DEVICE).t()
    _assert_same(_all_orders(dl.gelu, _leaves(strided)), _all_orders(F.gelu, _leaves(strided)))


@pytest.mark.parametrize("fused", [True, False])
def test_the_composition_elsewhere_equals_autograd(fused, monkeypatch):
    """Without the kernels (the CPU without the interpreter) the double backward is the composition
    (`ops.fused.layer_norm_double_backward`, `gelu_double_backward`); with them, the kernels."""
    if fused and not RUNS:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    if not fused:
        monkeypatch.setattr(dl, "available", lambda device: False)
    x, w, b = _layer_norm_inputs((6, 13), 13)
    _compare_layer_norm(x, w, b, 13)
    got = _all_orders(dl.gelu, _leaves(x))
    _assert_same(got, _all_orders(F.gelu, _leaves(x)))


def test_the_composition_keeps_the_kernels_output_dtypes():
    x, w, b = _layer_norm_inputs((4, 10), 10, device="cpu")
    y, mean, rstd = torch.ops.aten.native_layer_norm(x, [10], w, b, 1e-5)
    a, dy = torch.randn_like(x), torch.randn_like(x)
    g_x, g_w, g_dy = fused.layer_norm_double_backward(x.float(), w.float(), dy, a, w, b, mean.float(), rstd.float())
    assert (g_x.dtype, g_w.dtype, g_dy.dtype) == (torch.float32, torch.float32, torch.float64)
    gx, gdy = fused.gelu_double_backward(x.to(torch.bfloat16), dy, a)
    assert (gx.dtype, gdy.dtype) == (torch.bfloat16, torch.float64)


@needs_kernel
def test_gradcheck_and_gradgradcheck():
    x, w, b = _layer_norm_inputs((3, 7), 7)
    inputs = tuple(_leaves(x, w, b))
    fn = lambda x, w, b: dl.layer_norm(x, 7, w, b, 1e-5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)
    assert torch.autograd.gradcheck(dl.gelu, (inputs[0],))
    assert torch.autograd.gradgradcheck(dl.gelu, (inputs[0],))


def test_the_backward_leaves_out_the_gradients_autograd_grad_does_not_ask_for(monkeypatch):
    """torch.autograd.grad(.., x) skips the weight and bias gradients (as PyTorch's own LayerNorm node does);
    backward() computes all three."""
    masks = []
    apply = dl._LayerNormGrad.apply
    monkeypatch.setattr(dl._LayerNormGrad, "apply", lambda *args: masks.append(args[-1]) or apply(*args))
    x, w, b = _leaves(*_layer_norm_inputs((3, 7), 7))
    (gx,) = torch.autograd.grad(dl.layer_norm(x, 7, w, b).pow(3).sum(), x, create_graph=True)
    gx.pow(2).sum().backward()
    assert masks == [[True, False, False], [True, True, True]]
    assert w.grad is not None and b.grad is not None and float(w.grad.abs().max()) > 0


@pytest.mark.parametrize("layer", ["layer_norm", "gelu", "attention"])
def test_a_third_derivative_raises(layer):
    """(PyTorch's once_differentiable would let torch.autograd.grad prune its error and miss the terms.)"""
    x, w, b = _leaves(*_layer_norm_inputs((2, 3, 4, 8), 8))
    fn = {"layer_norm": lambda: dl.layer_norm(x, 8, w, b), "gelu": lambda: dl.gelu(x),
          "attention": lambda: dl.double_attention.attention(x, x * 2, x * 3)}[layer]
    (gx,) = torch.autograd.grad(fn().pow(3).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="cannot be differentiated again"):
        torch.autograd.grad(gx.pow(2).sum(), x, create_graph=True)
    (gxx,) = torch.autograd.grad(gx.pow(2).sum(), x)  # a second derivative runs
    assert float(gxx.abs().max()) > 0


def test_autocast_runs_the_dtype_f_layer_norm_runs_in():
    """float32 on CUDA (autocast's float32 list), bfloat16 on the CPU."""
    x, w, b = _layer_norm_inputs((4, 12), 12, dtype=torch.float32)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        h = F.linear(x, torch.eye(12, device=DEVICE))  # bfloat16 under autocast
        got, want = dl.layer_norm(h, 12, w, b), F.layer_norm(h, (12,), w, b)
    assert h.dtype == torch.bfloat16 and got.dtype == want.dtype
    assert got.dtype == (torch.float32 if CUDA else torch.bfloat16)
    tol = 0 if CUDA else 1e-2  # the CPU's bfloat16 layer_norm takes a mixed-dtype path: within a rounding
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_named_errors():
    x, w, _ = _layer_norm_inputs((4, 12), 12, device="cpu")
    with pytest.raises(ValueError, match="layer_norm: expected x"):
        dl.layer_norm(x, 12, None)
    with pytest.raises(ValueError, match=r"layer_norm: expected x \[\.\.\., 11\]"):
        dl.layer_norm(x, 11, w[:11])


def _counted(monkeypatch):
    """Counts of the double-backward kernels' calls."""
    calls = {"layer_norm": 0, "gelu": 0}
    kernels = dl._kernels()
    for name in calls:
        original = getattr(kernels, name)

        def counted(*args, _name=name, _original=original):
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(kernels, name, counted)
    return calls


@pytest.mark.parametrize("arch", ["bert", "roberta"])
def test_installed_replaces_and_restores_the_layers(arch):
    from tests.conftest import tiny_model

    model = tiny_model(arch, attn="sdpa")
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    with dl.installed(model):
        assert all("forward" in m.__dict__ for m in norms)
        assert model.config._attn_implementation == dl.double_attention.NAME
        with dl.installed(model):  # nested: the inner block leaves the outer one's layers in place
            pass
        assert all("forward" in m.__dict__ for m in norms)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(KeyError), dl.installed(model):
        raise KeyError("inside")
    assert not any("forward" in m.__dict__ for m in model.modules())


def _gs_loss_and_grads(model, batch, pairs, fused, monkeypatch):
    from cat_fast.objectives import GradientSupervision

    # on the CPU the interpreter runs the kernels only where asked (GS takes them on CUDA by default)
    monkeypatch.setattr(GradientSupervision, "_double_layers", lambda self, device: fused)
    model.zero_grad()
    loss, info = GradientSupervision(model, representation=0, mode="exact")(batch, pairs)
    loss.backward()
    return loss.detach(), info["gs_loss"], [p.grad.clone() for p in model.parameters() if p.grad is not None]


@needs_kernel
@pytest.mark.parametrize("arch", ["bert", "roberta"])
def test_exact_gs_at_a_layer_on_the_fused_layers_equals_eager(arch, monkeypatch):
    from tests.conftest import tiny_batch, tiny_model

    batch = {k: v.to(DEVICE) for k, v in tiny_batch(arch).items()}
    pairs = torch.tensor([1, 0, 3, 2], device=DEVICE)
    sdpa = tiny_model(arch, attn="sdpa", dtype=torch.float64).to(DEVICE).eval()
    eager = tiny_model(arch, attn="eager", dtype=torch.float64).to(DEVICE).eval()
    calls = _counted(monkeypatch)
    got = _gs_loss_and_grads(sdpa, batch, pairs, True, monkeypatch)
    layers = sdpa.config.num_hidden_layers
    assert calls == {"layer_norm": 2 * layers, "gelu": layers}  # every LayerNorm and GELU past h_0, twice
    want = _gs_loss_and_grads(eager, batch, pairs, False, monkeypatch)
    assert calls == {"layer_norm": 2 * layers, "gelu": layers}
    assert sdpa.config._attn_implementation == "sdpa"
    assert float(got[1]) > 0 and len(got[2]) == len(want[2])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def _assert_close_to_max(got, want, tol):
    for a, b in zip(got[1:], want[1:]):
        for s, t in zip(a, b):
            torch.testing.assert_close(s.double(), t, atol=tol * float(t.abs().max()), rtol=tol)


@needs_cuda
def test_cuda_layer_norm_in_float32_against_float64():
    """The model's LayerNorms run in float32 under autocast."""
    x, w, b = _layer_norm_inputs((8, 128, 768), 768, dtype=torch.float32)
    got = _all_orders(lambda x, w, b: dl.layer_norm(x, 768, w, b), _leaves(x, w, b))
    want = _all_orders(lambda x, w, b: F.layer_norm(x, (768,), w, b), _leaves(x.double(), w.double(), b.double()))
    _assert_close_to_max(got, want, 1e-4)


@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_cuda_gelu_against_float64(dtype, tol):
    h = (3 * torch.randn(4, 128, 3072, device=DEVICE)).to(dtype)
    got = _all_orders(dl.gelu, _leaves(h))
    want = _all_orders(lambda t: F.gelu(t).to(dtype).double(), _leaves(h.double()))
    _assert_close_to_max(got, want, tol)
