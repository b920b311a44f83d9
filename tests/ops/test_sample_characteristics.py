"""sample_characteristics (CLP's ten per-sample characteristics): every fused backend against the reference composite
(docs/METHODS.md §5.1, docs/KERNELS.md "sample_characteristics"), closed forms, argument errors."""
import math

import pytest
import torch
import torch.nn.functional as F

import cat_fast
from cat_fast.kernels import reference
from cat_fast.ops import CHARACTERISTICS, sample_characteristics

from .conftest import assert_outputs_match, dtypes_for, noncontiguous, run, tolerance

OUTPUTS = ("characteristics", "grad_logits", "grad_features", "grad_class_weights")


def sample_inputs(shape, dtype, device, seed, ignored="none"):
    """logits, labels, features, class_weights (dtype) and class_stats (float64 on the CPU, float32 on CUDA) for
    shape (B, C, H); `ignored`: "none", "some" (every third row from the second) or "all" rows labelled -100."""
    B, C, H = shape
    g = torch.Generator().manual_seed(seed)
    stats_dtype = torch.float64 if device == "cpu" else torch.float32

    def randn(*size, scale=1.0):
        return (scale * torch.randn(*size, generator=g, dtype=torch.float64)).to(device=device, dtype=dtype)

    logits = randn(B, C, scale=2.0)
    features = randn(B, H)
    weights = randn(C, H, scale=1 / math.sqrt(H))
    prior = torch.softmax(torch.randn(C, generator=g, dtype=torch.float64), 0)
    stats = torch.stack((prior, 2 * torch.rand(C, generator=g, dtype=torch.float64),
                         2 * torch.rand(C, generator=g, dtype=torch.float64) - 1), 1).to(device, stats_dtype)
    labels = torch.randint(0, C, (B,), generator=g)
    if ignored == "some":
        labels[1::3] = -100
    elif ignored == "all":
        labels[:] = -100
    return logits, labels.to(device), features, weights, stats


def _outputs(which, logits, labels, features, weights, stats, grad_out, **kwargs):
    z, f, w = (t.detach().requires_grad_() for t in (logits, features, weights))
    out = run(which, sample_characteristics, z, labels, f, w, stats, **kwargs)
    out.backward(grad_out.to(device=out.device, dtype=out.dtype))
    return out, z.grad, f.grad, w.grad


def _grad_out(B, seed):
    return torch.randn(B, len(CHARACTERISTICS), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("shape", [(1, 2, 3), (8, 3, 5), (33, 7, 16), (4, 130, 9), (20, 2, 33)], ids=str)
@pytest.mark.parametrize("ignored", ["none", "some"])
def test_matches_reference(backend, device, shape, ignored):
    dtypes = dtypes_for(device)
    if backend == "triton" and device == "cpu" and shape[1] > 100:
        dtypes = dtypes[1:2]  # Triton's interpreter runs a program per class: one dtype keeps this case quick
    for seed, dtype in enumerate(dtypes):
        inputs = sample_inputs(shape, dtype, device, seed, ignored)
        grad_out = _grad_out(shape[0], seed)
        got = _outputs(backend, *inputs, grad_out)
        same = _outputs("reference", *inputs, grad_out)
        logits, labels, features, weights, stats = inputs
        truth = _outputs("reference", logits.double(), labels, features.double(), weights.double(), stats.double(),
                         grad_out)
        # grad W_c sums the rows of class c, each a dot product over H
        assert_outputs_match(OUTPUTS, got, same, truth, dtype, terms={"grad_class_weights": shape[0] * shape[2]})
        kept = labels != -100
        assert not got[0][~kept].any() and not got[1][~kept].any() and not got[2][~kept].any()
        absent = torch.ones(shape[1], dtype=torch.bool, device=device)
        absent[labels[kept]] = False
        assert not got[3][absent].any()  # a class without rows: an exactly zero weight-gradient row


def test_every_row_ignored_gives_zeros(backend, device):
    inputs = sample_inputs((5, 3, 4), torch.float32, device, 1, ignored="all")
    got = _outputs(backend, *inputs, torch.ones(5, 10))
    for tensor in got:
        assert not tensor.any()


def test_noncontiguous_inputs(backend, device):
    logits, labels, features, weights, stats = sample_inputs((6, 4, 5), torch.float32, device, 2, ignored="some")
    grad_out = _grad_out(6, 2)
    got = _outputs(backend, noncontiguous(logits), noncontiguous(labels), noncontiguous(features),
                   noncontiguous(weights), noncontiguous(stats), grad_out)
    expected = _outputs("reference", logits, labels, features, weights, stats, grad_out)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **tolerance(torch.float32))


def _gradcheck_inputs(device):
    """float64 inputs that cover both sides of each norm clamp at eps = 0.5: rows 0 and 3 have |f| < eps, class 2 has
    |W_2| < eps, class 1 has |W_1| > eps; row 2 is ignored."""
    logits, labels, features, weights, stats = sample_inputs((6, 3, 4), torch.float64, device, 5)
    labels = torch.tensor([2, 1, -100, 1, 2, 0], device=device)
    features = features.clone()
    features[0] *= 0.1 / features[0].norm()
    features[3] *= 0.2 / features[3].norm()
    weights = weights.clone()
    weights[2] *= 0.3 / weights[2].norm()
    weights[1] *= 2.0 / weights[1].norm()
    return logits, labels, features, weights, stats


@pytest.mark.parametrize("eps", [1e-8, 0.5])
def test_gradcheck(backend, device, eps):
    if device != "cpu":
        pytest.skip("float64 gradcheck runs on the CPU")
    logits, labels, features, weights, stats = _gradcheck_inputs(device)
    inputs = tuple(t.requires_grad_() for t in (logits, features, weights))

    def fn(z, f, w):
        return run(backend, sample_characteristics, z, labels, f, w, stats, eps=eps)

    interpreted = backend == "triton"  # Triton's interpreter: random projections, not the full Jacobian (speed)
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=interpreted)


@pytest.mark.parametrize("eps", [1e-8, 0.5])
def test_gradcheck_of_the_reference(eps):
    logits, labels, features, weights, stats = _gradcheck_inputs("cpu")
    inputs = tuple(t.requires_grad_() for t in (logits, features, weights))

    def fn(z, f, w):
        return reference.sample_characteristics(z, labels, f, w, stats, eps)

    assert torch.autograd.gradcheck(fn, inputs)


def test_double_backward_raises(backend, device):
    logits, labels, features, weights, stats = sample_inputs((4, 3, 5), torch.float32, device, 6)
    logits.requires_grad_()
    out = run(backend, sample_characteristics, logits, labels, features, weights, stats)
    (grad,) = torch.autograd.grad(out.sum(), logits, create_graph=True)
    with pytest.raises(RuntimeError, match="sample_characteristics: double backward is not supported"):
        grad.sum().backward()


def test_uniform_logits(backend, device):
    """Uniform logits: loss log C, margin 0, ‖1 − p‖ = (C − 1)/√C, Σ p log p = −log C; features along ±W_y give
    cosine ±1; the class-stat columns are copied and subtracted."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    B, C, H = 6, 5, 7
    _, labels, _, weights, stats = sample_inputs((B, C, H), dtype, device, 7)
    logits = torch.full((B, C), 0.25, device=device, dtype=dtype)
    sign = torch.tensor([1.0, -1.0, 2.0, -0.5, 3.0, 1.0], device=device, dtype=dtype)
    features = sign[:, None] * weights[labels]
    out = run(backend, sample_characteristics, logits, labels, features, weights, stats)
    s = stats.to(out.dtype)[labels]
    columns = ([math.log(C)] * B, [0.0] * B, [(C - 1) / math.sqrt(C)] * B, sign.sign().tolist(), [-math.log(C)] * B)
    expected = torch.tensor(columns, dtype=torch.float64).T.to(device, out.dtype)
    tol = tolerance(dtype)
    torch.testing.assert_close(out[:, :5], expected, **tol)
    torch.testing.assert_close(out[:, 5], s[:, 0], **tol)
    torch.testing.assert_close(out[:, 6], s[:, 1], **tol)
    torch.testing.assert_close(out[:, 7], weights[labels].to(out.dtype).norm(dim=1), **tol)
    torch.testing.assert_close(out[:, 8], math.log(C) - s[:, 1], **tol)
    torch.testing.assert_close(out[:, 9], -s[:, 2], **tol)


def test_two_class_example_by_hand(backend, device):
    """logits (0, log 3), label 1: p = (1/4, 3/4); features (3, 4), W_1 = (4, 3): cosine 24/25, ‖W_1‖ = 5."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    logits = torch.tensor([[0.0, math.log(3)]], device=device, dtype=dtype, requires_grad=True)
    labels = torch.tensor([1], device=device)
    features = torch.tensor([[3.0, 4.0]], device=device, dtype=dtype, requires_grad=True)
    weights = torch.tensor([[1.0, 0.0], [4.0, 3.0]], device=device, dtype=dtype, requires_grad=True)
    stats = torch.tensor([[0.7, 1.0, 0.1], [0.3, 0.5, 0.2]], device=device, dtype=dtype)
    out = run(backend, sample_characteristics, logits, labels, features, weights, stats)
    expected = [math.log(4 / 3), 0.5, math.sqrt(10) / 4, 24 / 25, 0.25 * math.log(0.25) + 0.75 * math.log(0.75),
                0.3, 0.5, 5.0, math.log(4 / 3) - 0.5, 0.5 - 0.2]
    tol = tolerance(dtype)
    torch.testing.assert_close(out, torch.tensor([expected], device=device, dtype=out.dtype), **tol)
    # d loss / d z = p - onehot(y); d ‖W_y‖ / d W = W_y / ‖W_y‖ on row y only
    select = torch.zeros_like(out)
    select[0, 0] = select[0, 7] = 1.0
    grad_logits, grad_weights = torch.autograd.grad(out, (logits, weights), select)
    torch.testing.assert_close(grad_logits, torch.tensor([[0.25, -0.25]], device=device, dtype=dtype), **tol)
    torch.testing.assert_close(grad_weights, torch.tensor([[0.0, 0.0], [0.8, 0.6]], device=device, dtype=dtype), **tol)


def test_definitions_match_torch(backend, device):
    """Column 2 is ‖1 − p‖₂ with 1 the all-ones vector (not the one-hot label), column 3 is F.cosine_similarity."""
    logits, labels, features, weights, stats = sample_inputs((9, 4, 6), torch.float32, device, 8)
    out = run(backend, sample_characteristics, logits, labels, features, weights, stats)
    tol = tolerance(torch.float32)
    torch.testing.assert_close(out[:, 2], torch.linalg.vector_norm(1 - logits.softmax(-1), dim=-1), **tol)
    torch.testing.assert_close(out[:, 3], F.cosine_similarity(features, weights[labels], dim=-1), **tol)
    torch.testing.assert_close(out[:, 0], F.cross_entropy(logits, labels, reduction="none"), **tol)


def test_margin_takes_the_first_of_tied_other_classes(backend, device):
    """Logits (3, 1, 3, 3), label 0: the other class is index 2 (the first of the tied 2 and 3) on every backend."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    logits = torch.tensor([[3.0, 1.0, 3.0, 3.0]], device=device, dtype=dtype, requires_grad=True)
    _, _, features, weights, stats = sample_inputs((1, 4, 3), dtype, device, 9)
    out = run(backend, sample_characteristics, logits, torch.tensor([0], device=device), features, weights, stats)
    select = torch.zeros_like(out)
    select[0, 1] = 1.0
    (grad,) = torch.autograd.grad(out, logits, select)
    p = logits.detach().softmax(-1)[0]
    expected = p[0] * (torch.eye(4, device=device, dtype=dtype)[0] - p) - p[2] * (torch.eye(4, device=device,
                                                                                             dtype=dtype)[2] - p)
    torch.testing.assert_close(grad[0], expected, **tolerance(dtype))
    assert out[0, 1].item() == pytest.approx(0.0, abs=1e-12)


def test_weight_gradient_is_bitwise_reproducible(backend, device):
    shape = (64, 3, 24) if backend == "triton" and device == "cpu" else (1500, 3, 96)
    inputs = sample_inputs(shape, torch.float32, device, 10, ignored="some")
    grad_out = _grad_out(shape[0], 10)
    first = _outputs(backend, *inputs, grad_out)
    if device == "cpu" and backend == "cpp":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            single = _outputs(backend, *inputs, grad_out)
        finally:
            torch.set_num_threads(threads)
        for a, b in zip(first, single):
            assert torch.equal(a, b)
    for a, b in zip(first, _outputs(backend, *inputs, grad_out)):
        assert torch.equal(a, b)


def test_large_inputs_match_reference(backend, device):
    """More rows than a program's tile and more classes than blocks of one wave."""
    if backend == "triton" and device == "cpu":
        shapes = [(70, 3, 40)]
    elif device == "cpu":
        shapes = [(700, 3, 50), (40, 300, 20)]
    else:
        shapes = [(5000, 3, 768), (256, 1000, 64), (96, 5, 2500)]
    for shape in shapes:
        inputs = sample_inputs(shape, torch.float32, device, 11, ignored="some")
        grad_out = _grad_out(shape[0], 11)
        got = _outputs(backend, *inputs, grad_out)
        logits, labels, features, weights, stats = inputs
        truth = _outputs("reference", logits.double(), labels, features.double(), weights.double(), stats.double(),
                         grad_out)
        assert_outputs_match(OUTPUTS, got, got, truth, torch.float32,
                             terms={"grad_class_weights": shape[0] * shape[2], "grad_features": shape[2]})


def test_one_launch_per_direction(backend, device):
    """The characteristics are the forward kernel op alone, the three gradients the backward kernel op alone (no
    gather, index_add or zero fill around them)."""
    logits, labels, features, weights, stats = sample_inputs((8, 3, 5), torch.float32, device, 12)
    inputs = tuple(t.detach().requires_grad_() for t in (logits, features, weights))
    with torch.profiler.profile() as forward:
        out = run(backend, sample_characteristics, inputs[0], labels, inputs[1], inputs[2], stats)
    seed = torch.ones_like(out)
    with torch.profiler.profile() as backward:
        torch.autograd.grad(out, inputs, grad_outputs=seed)
    compute = ("aten::gather", "aten::index", "aten::index_select", "aten::index_add_", "aten::index_put_", "aten::sum",
            "aten::mul", "aten::div", "aten::_softmax", "aten::_log_softmax", "aten::linalg_vector_norm")
    names = [event.name for event in forward.events()]  # (CPU labels: the range check's min / max run too)
    assert any("sample_characteristics_forward" in n for n in names)
    assert not any(n in compute for n in names), names
    names = [event.name for event in backward.events()]
    assert any("sample_characteristics_backward" in n for n in names)
    banned = compute + ("aten::zeros", "aten::zero_", "aten::fill_", "aten::zeros_like")
    assert not any(n in banned for n in names), names


def test_opcheck(backend, device):
    logits, labels, features, weights, stats = sample_inputs((5, 3, 4), torch.float32, device, 13)
    stats = stats.float()
    kernels = cat_fast.ops.registry.kernels(backend)
    for ignore_index in (-100, 2):
        y = labels.clone()
        y[1] = ignore_index
        args = tuple(t.detach().requires_grad_() for t in (logits, features, weights))
        torch.library.opcheck(kernels.sample_characteristics_forward.default,
                              (args[0], y, args[1], args[2], stats, 1e-8, ignore_index))
        grad = torch.randn(5, 10, device=device)
        torch.library.opcheck(kernels.sample_characteristics_backward.default,
                              (grad, logits, y, features, weights, 1e-8, ignore_index))


def test_compiles(backend, device):
    logits, labels, features, weights, stats = sample_inputs((6, 3, 5), torch.float32, device, 14)
    stats = stats.float()

    def step(z, f, w):
        chars = sample_characteristics(z, labels, f, w, stats)
        return (chars * torch.arange(1, 11, device=chars.device)).sum()

    inputs = tuple(t.detach().requires_grad_() for t in (logits, features, weights))
    with cat_fast.use_backend(backend):
        eager = step(*inputs)
        eager_grads = torch.autograd.grad(eager, inputs)
        compiled = torch.compile(step)(*inputs)
        compiled_grads = torch.autograd.grad(compiled, inputs)
    torch.testing.assert_close(compiled, eager)
    for c, e in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(c, e)


def _args(**changes):
    args = dict(logits=torch.randn(3, 2), labels=torch.tensor([0, 1, 1]), features=torch.randn(3, 4),
                class_weights=torch.randn(2, 4), class_stats=torch.rand(2, 3))
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes, error, words",
    [
        (dict(logits=torch.randn(3, 1), class_weights=torch.randn(1, 4), class_stats=torch.rand(1, 3)), ValueError,
         "logits: expected at least two classes"),
        (dict(logits=torch.randn(3)), ValueError, "logits: expected a 2-D tensor"),
        (dict(logits=torch.randn(0, 2), labels=torch.zeros(0, dtype=torch.long), features=torch.randn(0, 4)),
         ValueError, "logits: expected at least one row"),
        (dict(labels=torch.tensor([0, 1, 2])), ValueError, "labels: expected values in [0, 2)"),
        (dict(labels=torch.tensor([0.0, 1.0, 1.0])), TypeError, "labels: expected dtype"),
        (dict(labels=torch.tensor([0, 1])), ValueError, "labels: expected size 3"),
        (dict(features=torch.randn(2, 4)), ValueError, "features: expected size 3 in dim 0"),
        (dict(features=torch.randn(3, 0), class_weights=torch.randn(2, 0)), ValueError,
         "features: expected at least one column"),
        (dict(features=torch.randn(3, 4, dtype=torch.float64)), TypeError,
         "features: expected dtype float32 (the dtype of logits)"),
        (dict(class_weights=torch.randn(2, 5)), ValueError, "class_weights: expected shape (2, 4)"),
        (dict(class_weights=torch.randn(2, 4).bfloat16()), TypeError, "class_weights: expected dtype float32"),
        (dict(class_stats=torch.rand(2, 2)), ValueError, "class_stats: expected shape (2, 3)"),
        (dict(class_stats=torch.ones(2, 3, dtype=torch.long)), TypeError, "class_stats: expected dtype"),
        (dict(class_weights=[[1.0]]), TypeError, "class_weights: expected a torch.Tensor"),
        (dict(eps=0.0), ValueError, "eps: expected a finite number > 0"),
        (dict(eps=float("nan")), ValueError, "eps: expected a finite number > 0"),
        (dict(eps="small"), TypeError, "eps: expected a number"),
        (dict(ignore_index=1.5), TypeError, "ignore_index: expected an int"),
    ],
)
def test_bad_input_names_the_argument(changes, error, words):
    args = _args(**changes)
    for which in ("reference", "cpp"):
        with pytest.raises(error) as caught:
            run(which, sample_characteristics, **args)
        assert words in str(caught.value)


def test_ignore_index_inside_the_class_range():
    """ignore_index = 1 with C = 3: rows labelled 1 are ignored, class 1 gets no weight gradient."""
    logits, labels, features, weights, stats = sample_inputs((9, 3, 4), torch.float64, "cpu", 15)
    labels[0] = 1
    grad_out = _grad_out(9, 15)
    got = _outputs("cpp", logits, labels, features, weights, stats, grad_out, ignore_index=1)
    expected = _outputs("reference", logits, labels, features, weights, stats, grad_out, ignore_index=1)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **tolerance(torch.float64))
    assert not got[0][labels == 1].any() and not got[3][1].any()
