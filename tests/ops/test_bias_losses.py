"""The bias-model losses (poe_loss, reweighted_loss, learned_mixin_loss, conf_reg_loss): every
fused backend against the reference composite (docs/METHODS.md §4, docs/KERNELS.md "bias_loss")."""
import inspect
import math
import pathlib
import re

import pytest
import torch
import torch.nn.functional as F

import cat_fast
from cat_fast.ops import BiasLoss, conf_reg_loss, learned_mixin_loss, poe_loss, reweighted_loss

from .conftest import assert_outputs_match, dtypes_for, noncontiguous, run, tolerance

# name -> (op, keyword arguments, reductions it takes)
LOSSES = {
    "poe": (poe_loss, {}, ("mean", "sum", "none")),
    "reweight": (reweighted_loss, {}, (None,)),
    "reweight-inverse": (reweighted_loss, dict(weight="inverse"), (None,)),
    "reweight-batch": (reweighted_loss, dict(normalize="batch"), (None,)),
    "reweight-inverse-batch": (reweighted_loss, dict(weight="inverse", normalize="batch"), (None,)),
    "learned-mixin": (learned_mixin_loss, dict(entropy_weight=0.03), ("mean", "sum", "none")),
    "learned-mixin-h1": (learned_mixin_loss, dict(entropy_weight=1.0), ("mean",)),
    "conf-reg": (conf_reg_loss, {}, ("mean", "sum", "none")),
}
CASES = [(name, reduction) for name, (_, _, reductions) in LOSSES.items() for reduction in reductions]


def loss_inputs(shape, dtype, device, seed):
    """logits (dtype), the bias's log-probabilities, the gate and the teacher's probabilities (float64 on the CPU,
    float32 on CUDA: as they come from a bias file / a linear head), labels."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.float64 if device == "cpu" else torch.float32
    logits = (2 * torch.randn(shape, generator=g, dtype=torch.float64)).to(device=device, dtype=dtype)
    bias = torch.log_softmax(3 * torch.randn(shape, generator=g, dtype=torch.float64), -1).to(device=device, dtype=aux)
    gate = (2 * torch.randn(shape[0], generator=g, dtype=torch.float64)).to(device=device, dtype=aux)
    teacher = torch.softmax(2 * torch.randn(shape, generator=g, dtype=torch.float64), -1).to(device=device, dtype=aux)
    labels = torch.randint(0, shape[1], (shape[0],), generator=g).to(device)
    return logits, bias, gate, teacher, labels


def call_loss(name, which, logits, bias, gate, teacher, labels, reduction, **extra):
    op, kwargs, _ = LOSSES[name]
    kwargs = dict(kwargs, **extra)
    if reduction is not None:
        kwargs["reduction"] = reduction
    if op is learned_mixin_loss:
        return run(which, op, logits, bias, labels, gate, **kwargs)
    if op is conf_reg_loss:
        return run(which, op, logits, bias, labels, teacher, **kwargs)
    return run(which, op, logits, bias, labels, **kwargs)


def _outputs(name, which, logits, bias, gate, teacher, labels, reduction, grad_out, **extra):
    z = logits.detach().requires_grad_()
    gt = gate.detach().requires_grad_()
    out = call_loss(name, which, z, bias, gt, teacher, labels, reduction, **extra)
    out.backward(grad_out.to(out.dtype))
    grad_gate = gt.grad if gt.grad is not None else torch.zeros_like(gt)
    return out, z.grad, grad_gate


def _ignored(labels, pattern, ignore_index=-100):
    labels = labels.clone()
    if pattern == "some":
        labels[1::3] = ignore_index
    elif pattern == "all":
        labels[:] = ignore_index
    return labels


@pytest.mark.parametrize("shape", [(1, 2), (8, 3), (33, 7), (4, 130)], ids=str)
@pytest.mark.parametrize("name, reduction", CASES)
@pytest.mark.parametrize("pattern", ["none", "some"])
def test_matches_reference(backend, device, shape, name, reduction, pattern):
    for seed, dtype in enumerate(dtypes_for(device)):
        logits, bias, gate, teacher, labels = loss_inputs(shape, dtype, device, seed)
        labels = _ignored(labels, pattern)
        grad_out = torch.randn(shape[0] if reduction == "none" else (), generator=torch.Generator().manual_seed(seed),
                               dtype=torch.float64).to(device)
        got = _outputs(name, backend, logits, bias, gate, teacher, labels, reduction, grad_out)
        same = _outputs(name, "reference", logits, bias, gate, teacher, labels, reduction, grad_out)
        truth = _outputs(name, "reference", logits.double(), bias.double(), gate.double(), teacher.double(), labels,
                         reduction, grad_out)
        assert_outputs_match(("loss", "grad_logits", "grad_gate"), got, same, truth, dtype)
        kept = labels != -100
        assert not got[1][~kept].any() and not got[2][~kept].any()  # ignored rows: exactly zero gradients
        if reduction == "none":
            assert not got[0][~kept].any()


@pytest.mark.parametrize("name", LOSSES)
def test_every_row_ignored_gives_nan_mean_and_zero_gradients(backend, device, name):
    logits, bias, gate, teacher, labels = loss_inputs((5, 3), torch.float32, device, 3)
    reduction = "mean" if LOSSES[name][2][0] else None
    got = _outputs(name, backend, logits, bias, gate, teacher, _ignored(labels, "all"), reduction,
                   torch.ones((), device=device))
    assert got[0].isnan()
    assert not got[1].any() and not got[2].any()


@pytest.mark.parametrize("name, reduction", CASES)
def test_noncontiguous_inputs(backend, device, name, reduction):
    logits, bias, gate, teacher, labels = loss_inputs((6, 3), torch.float32, device, 4)
    grad_out = torch.ones(6 if reduction == "none" else (), device=device)
    got = _outputs(name, backend, noncontiguous(logits), noncontiguous(bias), noncontiguous(gate),
                   noncontiguous(teacher), noncontiguous(labels), reduction, grad_out)
    expected = _outputs(name, "reference", logits, bias, gate, teacher, labels, reduction, grad_out)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **tolerance(torch.float32))


@pytest.mark.parametrize("name, reduction", CASES)
def test_gradcheck(backend, device, name, reduction):
    if device != "cpu":
        pytest.skip("float64 gradcheck runs on the CPU")
    logits, bias, gate, teacher, labels = loss_inputs((6, 3), torch.float64, device, 5)
    labels = _ignored(labels, "some")
    logits.requires_grad_()
    gate.requires_grad_()

    def fn(z, gt):
        return call_loss(name, backend, z, bias, gt, teacher, labels, reduction)

    assert torch.autograd.gradcheck(fn, (logits, gate))


def test_double_backward_raises(backend, device):
    logits, bias, gate, teacher, labels = loss_inputs((4, 3), torch.float32, device, 6)
    logits.requires_grad_()
    loss = run(backend, poe_loss, logits, bias, labels)
    (grad,) = torch.autograd.grad(loss, logits, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        grad.sum().backward()


def test_known_values(backend, device):
    """Closed forms: a uniform bias makes PoE the cross-entropy and reweighting (1 - 1/C) CE; a gate far below 0
    (g = softplus(gate) ~ 0) makes learned-mixin CE + w log C; a bias certain of the label makes the
    conf-reg target the teacher itself raised to 0 (uniform), one that gives it nothing leaves the teacher."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    logits, _, _, teacher, labels = loss_inputs((7, 4), dtype, device, 8)
    aux = teacher.dtype
    uniform = torch.full((7, 4), -math.log(4), device=device, dtype=aux)
    ce = F.cross_entropy(logits, labels)
    tol = tolerance(dtype)
    torch.testing.assert_close(run(backend, poe_loss, logits, uniform, labels), ce, **tol)
    torch.testing.assert_close(run(backend, reweighted_loss, logits, uniform, labels), ce, **tol)
    torch.testing.assert_close(run(backend, reweighted_loss, logits, uniform, labels, normalize="batch"), 0.75 * ce,
                               **tol)
    torch.testing.assert_close(run(backend, reweighted_loss, logits, uniform, labels, "batch", "inverse"), 4 * ce,
                               **tol)
    off = torch.full((7,), -60.0, device=device, dtype=aux)
    got = run(backend, learned_mixin_loss, logits, uniform, labels, off, entropy_weight=0.5)
    torch.testing.assert_close(got, ce + 0.5 * math.log(4), **tol)
    certain = torch.full((7, 4), -1e4, device=device, dtype=aux).scatter(1, labels[:, None], 0.0)
    got = run(backend, conf_reg_loss, logits, certain, labels, teacher)
    torch.testing.assert_close(got, -F.log_softmax(logits, -1).mean(-1).mean(), **tol)
    clueless = torch.full((7, 4), 0.0, device=device, dtype=aux).scatter(1, labels[:, None], -1e4)
    got = run(backend, conf_reg_loss, logits, clueless, labels, teacher)
    torch.testing.assert_close(got, -(teacher * F.log_softmax(logits, -1)).sum(-1).mean(), **tol)


def test_learned_mixin_gate_gradient_is_the_chain_rule(backend, device):
    """d loss / d gate = sigmoid(gate) · Σ_c b_c (q_c − onehot_c − w r_c (log r_c + H)), written out by hand."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    logits, bias, gate, _, labels = loss_inputs((5, 3), dtype, device, 9)
    gate = gate.to(dtype).requires_grad_()
    run(backend, learned_mixin_loss, logits, bias.to(dtype), labels, gate, 0.2, reduction="sum").backward()
    a = F.softplus(gate.detach())[:, None] * bias.to(dtype)
    q = torch.softmax(logits + a, -1)
    r_log = F.log_softmax(a, -1)
    entropy = -(r_log.exp() * r_log).sum(-1, keepdim=True)
    onehot = F.one_hot(labels, 3).to(dtype)
    expected = torch.sigmoid(gate.detach()) * (bias.to(dtype) * (q - onehot - 0.2 * r_log.exp() * (r_log + entropy))).sum(-1)
    torch.testing.assert_close(gate.grad, expected, **tolerance(dtype))


def _few_triton_programs(backend, device, monkeypatch):
    if backend == "triton" and device == "cpu":
        from cat_fast.kernels.triton import bias_loss as triton_bias

        if hasattr(triton_bias, "_MAX_PROGRAMS"):
            monkeypatch.setattr(triton_bias, "_MAX_PROGRAMS", 4)


@pytest.mark.parametrize("name", ["poe", "reweight", "learned-mixin", "conf-reg"])
def test_large_batch_matches_reference(backend, device, name, monkeypatch):
    """Batches large enough for the multi-block / multi-program mean: partial sums added by the last block."""
    _few_triton_programs(backend, device, monkeypatch)
    shapes = [(3000, 3)] if device == "cpu" else [(600_000, 3), (2500, 3), (3000, 300)]
    for shape in shapes:
        logits, bias, gate, teacher, labels = loss_inputs(shape, torch.float32, device, 12)
        labels[torch.arange(shape[0], device=device) % 7 == 2] = -100
        reduction = "mean" if LOSSES[name][2][0] else None
        got = _outputs(name, backend, logits, bias, gate, teacher, labels, reduction, torch.ones((), device=device))
        truth = _outputs(name, "reference", logits.double(), bias.double(), gate.double(), teacher.double(), labels,
                         reduction, torch.ones((), device=device, dtype=torch.float64))
        assert_outputs_match(("loss", "grad_logits", "grad_gate"), got, got, truth, torch.float32,
                             terms={"loss": shape[0]})


def test_large_batch_mean_is_bitwise_reproducible(backend, device, monkeypatch):
    _few_triton_programs(backend, device, monkeypatch)
    shape = (600_000, 3) if device == "cuda" else (3000, 3)
    logits, bias, gate, teacher, labels = loss_inputs(shape, torch.float32, device, 13)
    first = run(backend, reweighted_loss, logits, bias, labels)
    for rows in (100, shape[0] // 7):
        run(backend, reweighted_loss, logits[:rows], bias[:rows], labels[:rows])
    assert torch.equal(run(backend, reweighted_loss, logits, bias, labels), first)


def test_one_launch_per_direction(backend, device):
    """The loss is its forward kernel op (the reduction inside it: no aten sum or division after it), the gradient
    its backward kernel op (no zero-filled gradients for `denom`, no reduction)."""
    logits, bias, gate, teacher, labels = loss_inputs((8, 3), torch.float32, device, 14)
    z = logits.detach().requires_grad_()
    gt = gate.detach().requires_grad_()
    with torch.profiler.profile() as forward:
        loss = run(backend, learned_mixin_loss, z, bias, labels, gt)
    seed = torch.ones_like(loss)
    with torch.profiler.profile() as backward:
        torch.autograd.grad(loss, (z, gt), grad_outputs=seed)
    names = [event.name for event in forward.events()]
    assert any("bias_loss_forward" in n for n in names)
    assert not any(n in ("aten::sum", "aten::div", "aten::mean") for n in names), names
    names = [event.name for event in backward.events()]
    assert any("bias_loss_backward" in n for n in names)
    banned = ("aten::sum", "aten::div", "aten::zeros", "aten::zero_", "aten::fill_", "aten::zeros_like")
    assert not any(n in banned for n in names), names


def test_opcheck(backend, device):
    logits, bias, gate, teacher, labels = loss_inputs((5, 3), torch.float32, device, 15)
    bias, gate, teacher = bias.float(), gate.float(), teacher.float()
    labels[3] = 7
    kernels = cat_fast.ops.registry.kernels(backend)
    empty = logits.new_empty((0,))
    variants = ((BiasLoss.POE, empty), (BiasLoss.REWEIGHTED_ONE_MINUS, empty),
                (BiasLoss.REWEIGHTED_INVERSE_BATCH, empty), (BiasLoss.LEARNED_MIXIN, gate), (BiasLoss.CONF_REG, teacher))
    for variant, aux in variants:
        kind = int(variant)
        for reduction in (0, 1, 2):
            args = (logits.detach().requires_grad_(), bias, labels,
                    aux.detach().requires_grad_(variant == BiasLoss.LEARNED_MIXIN), kind, reduction, 0.03, 7)
            torch.library.opcheck(kernels.bias_loss_forward.default, args)
            _, denom = kernels.bias_loss_forward(*args)
            denom = denom.detach()
            grad = torch.randn(5 if reduction == 0 else (), device=device)
            torch.library.opcheck(kernels.bias_loss_backward.default,
                                  (grad, logits, bias, labels, aux, denom, kind, reduction, 0.03, 7))


def test_compiles(backend, device):
    logits, bias, gate, teacher, labels = loss_inputs((6, 3), torch.float32, device, 16)
    bias, gate = bias.float(), gate.float()

    def step(z, gt):
        return poe_loss(z, bias, labels) + learned_mixin_loss(z, bias, labels, gt) + reweighted_loss(z, bias, labels)

    z, gt = logits.detach().requires_grad_(), gate.detach().requires_grad_()
    with cat_fast.use_backend(backend):
        eager = step(z, gt)
        eager_grads = torch.autograd.grad(eager, (z, gt))
        compiled = torch.compile(step)(z, gt)
        compiled_grads = torch.autograd.grad(compiled, (z, gt))
    torch.testing.assert_close(compiled, eager)
    for c, e in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(c, e)


@pytest.mark.parametrize(
    "op, kwargs, error, words",
    [
        (poe_loss, dict(bias_log_probs=torch.randn(3, 3)), ValueError, "bias_log_probs: expected shape (3, 2)"),
        (poe_loss, dict(labels=torch.tensor([0, 1, 5])), ValueError, "labels: expected values in [0, 2)"),
        (poe_loss, dict(reduction="avg"), ValueError, "reduction: expected one of"),
        (poe_loss, dict(labels=torch.tensor([0.0, 1.0, 1.0])), TypeError, "labels"),
        (reweighted_loss, dict(normalize="rows"), ValueError, "normalize: expected one of"),
        (reweighted_loss, dict(weight="inv"), ValueError, "weight: expected one of"),
        (learned_mixin_loss, dict(gate=torch.randn(2)), ValueError, "gate"),
        (learned_mixin_loss, dict(entropy_weight=-1.0), ValueError, "entropy_weight: expected a finite number >= 0"),
        (learned_mixin_loss, dict(entropy_weight=float("nan")), ValueError, "entropy_weight"),
        (conf_reg_loss, dict(teacher_probs=torch.rand(3, 4)), ValueError, "teacher_probs: expected shape"),
    ],
)
def test_bad_input_names_the_argument(op, kwargs, error, words):
    args = dict(logits=torch.randn(3, 2), bias_log_probs=torch.randn(3, 2).log_softmax(-1),
                labels=torch.tensor([0, 1, 1]))
    if op is learned_mixin_loss:
        args["gate"] = torch.randn(3)
    if op is conf_reg_loss:
        args["teacher_probs"] = torch.rand(3, 2).softmax(-1)
    args.update(kwargs)
    for which in ("reference", "cpp"):
        with pytest.raises(error) as caught:
            run(which, op, **args)
        assert words in str(caught.value)


def test_each_loss_is_a_named_function_of_its_own_arguments():
    """One public function per loss, (logits, bias_log_probs, labels) first, then what that loss alone takes; no
    packed variant number or `aux` tensor reaches the API."""
    leading = ["logits", "bias_log_probs", "labels"]
    own = {poe_loss: [], reweighted_loss: ["normalize", "weight"], learned_mixin_loss: ["gate", "entropy_weight"],
           conf_reg_loss: ["teacher_probs"]}
    for op, extra in own.items():
        names = list(inspect.signature(op).parameters)
        assert names[:3 + len(extra)] == leading + extra, (op.__name__, names)
        assert not {"kind", "aux"} & set(names)
    for old in ("reweight_loss", "confidence_regularization_loss"):
        assert not hasattr(cat_fast.ops, old)


def _cpp_kinds():
    """{name: number} of `enum BiasLossKind` in csrc/checks/bias_loss.h, names lower-cased without the k."""
    text = (pathlib.Path(__file__).parents[2] / "csrc" / "checks" / "bias_loss.h").read_text()
    body = re.search(r"enum BiasLossKind[^{]*\{(.*?)\};", text, re.S).group(1)
    return {name.lower(): int(number) for name, number in re.findall(r"\bk(\w+) = (\d+),", body)}


def test_variant_numbers_agree_with_the_kernels():
    assert _cpp_kinds() == {v.name.replace("_", "").lower(): int(v) for v in BiasLoss}
    from cat_fast.kernels.triton import optional

    triton_bias = optional("bias_loss")
    if triton_bias is not None:
        assert (triton_bias.LEARNED_MIXIN, triton_bias.CONF_REG, triton_bias.KINDS) == (
            BiasLoss.LEARNED_MIXIN, BiasLoss.CONF_REG, len(BiasLoss))
