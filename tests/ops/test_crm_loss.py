import pytest
import torch

import cat_fast
from cat_fast.ops import crm_loss, crm_weights

from .conftest import assert_outputs_match, dtypes_for, noncontiguous, run, tolerance, without_ties


def _inputs(shape, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = without_ties(2 * torch.randn(shape, generator=generator, dtype=torch.float64)).to(device=device, dtype=dtype)
    cf_logits = without_ties(2 * torch.randn(shape, generator=generator, dtype=torch.float64)).to(device=device, dtype=dtype)
    labels = torch.randint(0, shape[1], (shape[0],), generator=generator).to(device)
    return logits, cf_logits, labels


@pytest.mark.parametrize("shape", [(1, 2), (8, 3), (33, 7), (4, 130)], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("detach_weight", [True, False])
@pytest.mark.parametrize("clip", [(0.0, 10.0), (0.9, 1.2)], ids=["paper", "tight"])
def test_matches_reference(backend, device, shape, reduction, detach_weight, clip):
    for seed, dtype in enumerate(dtypes_for(device)):
        logits, cf_logits, labels = _inputs(shape, dtype, device, seed)
        grad_out = torch.randn(shape[0] if reduction == "none" else (), generator=torch.Generator().manual_seed(100 + seed), dtype=torch.float64).to(device)

        def outputs(which, logits, cf_logits):
            z = logits.detach().requires_grad_()
            z_cf = cf_logits.detach().requires_grad_()
            out = run(which, crm_loss, z, z_cf, labels, *clip, detach_weight, reduction)
            out.backward(grad_out.to(out.dtype))
            grad_cf = z_cf.grad if z_cf.grad is not None else torch.zeros_like(z_cf)
            return out, z.grad, grad_cf

        truth = outputs("reference", logits.double(), cf_logits.double())
        names = ("loss", "grad_logits", "grad_cf_logits")
        assert_outputs_match(names, outputs(backend, logits, cf_logits), outputs("reference", logits, cf_logits), truth, dtype)


def _few_triton_programs(backend, device, monkeypatch):
    """On the CPU (Triton interpreter) cap the mean/sum forward at 4 programs, so a few thousand rows
    already give several programs, each over several row tiles."""
    if backend == "triton" and device == "cpu":
        from cat_fast.kernels.triton import crm_loss as triton_crm

        monkeypatch.setattr(triton_crm, "_MAX_PROGRAMS", 4)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_large_batch_matches_reference(backend, device, reduction, monkeypatch):
    """Batches large enough for the multi-block (CUDA) / multi-program (Triton) mean and sum: per-block
    partial sums added by the block that finishes last."""
    _few_triton_programs(backend, device, monkeypatch)
    # cuda: C=3 -> one thread per row, groups of 1024 rows: 586 blocks of one group (600,000 rows), 3 blocks
    # (2,500 rows: few groups, but over the 1,024 rows of a single block); C=300 -> 1000 blocks of one 3-row
    # group; C=1000 -> one 1024-thread row per group, 1000 blocks of 2 groups
    shapes = [(5000, 3), (700, 130)] if device == "cpu" else [(600_000, 3), (2500, 3), (3000, 300), (2000, 1000)]
    for shape in shapes:
        for seed, dtype in enumerate(dtypes_for(device)[:2]):
            logits, cf_logits, labels = _inputs(shape, dtype, device, seed)
            got = run(backend, crm_loss, logits, cf_logits, labels, 0.5, 2.0, True, reduction)
            truth = run("reference", crm_loss, logits.double(), cf_logits.double(), labels, 0.5, 2.0, True, reduction)
            assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and got.shape == ()
            torch.testing.assert_close(got.double(), truth, **tolerance(dtype), msg=lambda m: f"{shape} {dtype}: {m}")


def test_large_batch_mean_is_bitwise_reproducible(backend, device, monkeypatch):
    """Fixed summation order, no float atomics: repeated calls give the same bits, also after calls of other
    sizes in between (each launch resets its completion counter) and, on CUDA, from two streams at once
    (one counter per stream)."""
    _few_triton_programs(backend, device, monkeypatch)
    shape = (600_000, 3) if device == "cuda" else (5000, 3)
    logits, cf_logits, labels = _inputs(shape, torch.float32, device, 11)

    def loss(rows=shape[0]):
        return run(backend, crm_loss, logits[:rows], cf_logits[:rows], labels[:rows], 0.0, 10.0, True, "mean")

    first = loss()
    truth = run("reference", crm_loss, logits.double(), cf_logits.double(), labels, 0.0, 10.0, True, "mean")
    torch.testing.assert_close(first.double(), truth, **tolerance(torch.float32))
    for rows in (100, shape[0] // 7, shape[0]):
        got = loss(rows)
        expected = run("reference", crm_loss, logits[:rows].double(), cf_logits[:rows].double(), labels[:rows],
                       0.0, 10.0, True, "mean")
        torch.testing.assert_close(got.double(), expected, **tolerance(torch.float32), msg=lambda m: f"{rows} rows: {m}")
    assert torch.equal(loss(), first)
    if device == "cuda":
        main = torch.cuda.current_stream()
        streams = (torch.cuda.Stream(), torch.cuda.Stream())
        results = []
        for stream in streams:
            stream.wait_stream(main)
        for _ in range(8):
            for stream in streams:
                with torch.cuda.stream(stream):
                    results.append(loss())
        for stream in streams:
            main.wait_stream(stream)
        torch.cuda.synchronize()
        for got in results:
            assert torch.equal(got, first)


def test_cuda_row_values_do_not_depend_on_the_reduction_path(backend, device):
    """The multi-block mean keeps the row slots of the single-block one (and, for C <= 256, of reduction
    none): the same stats bits for the same rows."""
    if backend != "cuda":
        pytest.skip("row-slot layout of the CUDA kernels")
    logits, cf_logits, labels = _inputs((600_000, 3), torch.float32, device, 12)
    forward = cat_fast.ops.registry.kernels(backend).crm_loss_forward
    _, stats = forward(logits, cf_logits, labels, 0.5, 2.0, 1, True)
    _, stats_single = forward(logits[:1000], cf_logits[:1000], labels[:1000], 0.5, 2.0, 1, True)  # one block
    _, stats_none = forward(logits, cf_logits, labels, 0.5, 2.0, 0, True)
    assert torch.equal(stats[:1000], stats_single)
    assert torch.equal(stats, stats_none)


def test_detached_weight_gives_weighted_cross_entropy_gradient(backend, device):
    logits, cf_logits, labels = _inputs((6, 3), torch.float64 if device == "cpu" else torch.float32, device, 8)
    logits.requires_grad_()
    cf_logits.requires_grad_()
    run(backend, crm_loss, logits, cf_logits, labels, 0.0, 10.0, True, "sum").backward()
    weight = run("reference", crm_weights, logits.detach(), cf_logits.detach())
    onehot = torch.nn.functional.one_hot(labels, 3).to(logits.dtype)
    torch.testing.assert_close(logits.grad, weight[:, None] * (logits.detach().softmax(-1) - onehot))
    assert cf_logits.grad is None


def test_backward_runs_only_the_backward_kernel(backend, device):
    """No zero-filled gradient for the unused `stats` output: the backward is the one fused kernel."""
    logits, cf_logits, labels = _inputs((8, 3), torch.float32, device, 5)
    logits.requires_grad_()
    loss = run(backend, crm_loss, logits, cf_logits, labels)
    seed = torch.ones_like(loss)
    with torch.profiler.profile() as prof:
        torch.autograd.grad(loss, logits, grad_outputs=seed)
    names = [event.name for event in prof.events()]
    assert any("crm_loss_backward" in name for name in names)
    assert not any(name in ("aten::zeros", "aten::zero_", "aten::fill_", "aten::zeros_like") for name in names), names


def test_weights_match_reference(backend, device):
    logits, cf_logits, _ = _inputs((9, 4), torch.float32, device, 4)
    expected = run("reference", crm_weights, logits, cf_logits, 0.9, 2.0)
    got = run(backend, crm_weights, noncontiguous(logits), noncontiguous(cf_logits), 0.9, 2.0)
    torch.testing.assert_close(got, expected)
    assert ((got >= 0.9) & (got <= 2.0)).all()


def test_gradcheck(backend, device):
    # Only the non-detached loss is the derivative of its own forward: a detached weight is a constant
    # by design (its gradients are compared with the reference in test_matches_reference).
    if device != "cpu":
        pytest.skip("float64 gradcheck runs on the CPU")
    logits, cf_logits, labels = _inputs((5, 3), torch.float64, device, 6)
    logits.requires_grad_()
    cf_logits.requires_grad_()

    def fn(z, z_cf):
        return run(backend, crm_loss, z, z_cf, labels, 0.0, 10.0, False, "none")

    assert torch.autograd.gradcheck(fn, (logits, cf_logits))


def test_opcheck(backend, device):
    logits, cf_logits, labels = _inputs((4, 3), torch.float32, device, 2)
    kernels = cat_fast.ops.registry.kernels(backend)
    for reduction in (0, 1):
        torch.library.opcheck(
            kernels.crm_loss_forward.default,
            (logits.detach().requires_grad_(), cf_logits.detach().requires_grad_(), labels, 0.0, 10.0, reduction, False),
        )
    _, stats = kernels.crm_loss_forward(logits, cf_logits, labels, 0.0, 10.0, 0, True)
    grad = torch.randn(4, device=device)
    torch.library.opcheck(kernels.crm_loss_backward.default, (grad, logits, cf_logits, labels, stats, 0.0, 10.0, 0, False))


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(a1=2.0, a2=1.0), ValueError, "a1, a2: expected a1 <= a2"),
        (dict(cf_logits=torch.randn(3, 3)), ValueError, "cf_logits: expected shape (3, 2)"),
        (dict(cf_logits=torch.randn(3, 2, dtype=torch.float64)), TypeError, "cf_logits: expected dtype torch.float32"),
        (dict(labels=torch.tensor([0, 1, 5])), ValueError, "labels: expected values in [0, 2)"),
        (dict(reduction="avg"), ValueError, "reduction: expected one of"),
        (dict(detach_weight=1), TypeError, "detach_weight: expected a bool"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, words):
    args = dict(logits=torch.randn(3, 2), cf_logits=torch.randn(3, 2), labels=torch.tensor([0, 1, 1]))
    args.update(kwargs)
    with pytest.raises(error) as caught:
        crm_loss(**args)
    assert words in str(caught.value)


TIES = [[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 5.0, -1.0, 5.0]]
CF_TIES = [[0.0, 2.0, 0.5, 2.0], [1.0, 4.0, 4.0, 4.0], [3.0, 3.0, 0.0, 0.0]]


def test_tied_maxima_give_the_first_index_the_phi_gradient(backend, device):
    """Phi's subgradient at tied maxima goes to the FIRST tied index (torch.argmax's), on every backend, for both
    logits and cf_logits (detach_weight=False, weights strictly inside the clip range)."""
    for dtype in dtypes_for(device):
        logits = torch.tensor(TIES, dtype=torch.float64).to(device=device, dtype=dtype)
        cf_logits = torch.tensor(CF_TIES, dtype=torch.float64).to(device=device, dtype=dtype)
        labels = torch.tensor([0, 1, 2], device=device)
        grads = {}
        for which in ("reference", backend):
            z, z_cf = logits.detach().requires_grad_(), cf_logits.detach().requires_grad_()
            run(which, crm_loss, z, z_cf, labels, 0.0, 10.0, False, "sum").backward()
            grads[which] = (z.grad, z_cf.grad)
        z, zc = logits.double(), cf_logits.double()
        p, pc = z.softmax(-1), zc.softmax(-1)
        phi, phi_cf = p.amax(-1, keepdim=True), pc.amax(-1, keepdim=True)
        ce = torch.nn.functional.cross_entropy(z, labels.cpu().to(z.device), reduction="none")[:, None]
        onehot = torch.nn.functional.one_hot
        dphi = phi * (onehot(z.argmax(-1), 4).double() - p)
        dphi_cf = phi_cf * (onehot(zc.argmax(-1), 4).double() - pc)
        w = phi / phi_cf
        assert ((w > 0) & (w < 10)).all()
        expected = (w * (p - onehot(labels.cpu().to(z.device), 4).double()) + ce / phi_cf * dphi,
                    -ce * phi / phi_cf**2 * dphi_cf)
        tol = tolerance(dtype)
        for name, ref, got, want in zip(("grad_logits", "grad_cf_logits"), grads["reference"], grads[backend], expected):
            torch.testing.assert_close(ref.double(), want, **tol, msg=lambda m: f"reference {name} {dtype}: {m}")
            torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"{backend} {name} {dtype}: {m}")


@pytest.mark.parametrize("a1, a2", [(float("-inf"), 1.5), (0.5, float("inf")), (float("-inf"), float("inf"))])
def test_infinite_clip_bounds_match_reference(backend, device, a1, a2):
    logits, cf_logits, labels = _inputs((7, 3), torch.float32, device, 9)
    for detach_weight in (True, False):
        grads = []
        for which in ("reference", backend):
            z, z_cf = logits.detach().requires_grad_(), cf_logits.detach().requires_grad_()
            loss = run(which, crm_loss, z, z_cf, labels, a1, a2, detach_weight, "sum")
            loss.backward()
            grads.append((loss, z.grad))
        torch.testing.assert_close(grads[1][0], grads[0][0])
        torch.testing.assert_close(grads[1][1], grads[0][1])
    torch.testing.assert_close(run(backend, crm_weights, logits, cf_logits, a1, a2),
                               run("reference", crm_weights, logits, cf_logits, a1, a2))


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(a1=float("nan")), ValueError, "a1: expected a number that is not NaN"),
        (dict(a2=float("nan")), ValueError, "a2: expected a number that is not NaN"),
        (dict(a1=float("nan"), a2=float("nan")), ValueError, "a1: expected a number that is not NaN"),
        (dict(a1="0"), TypeError, "a1: expected a number"),
        (dict(labels=torch.tensor([0, -100, 1])), None, None),
        (dict(labels=torch.tensor([0, -3, 1])), ValueError, "labels: expected values in [0, 2) (class indices of logits) or ignore_index=-100"),
        (dict(labels=torch.tensor([0, 5, 1]), ignore_index=5), None, None),
        (dict(ignore_index=0.5), TypeError, "ignore_index: expected an int"),
    ],
)
def test_clip_bounds_and_ignore_index_arguments(kwargs, error, words):
    args = dict(logits=torch.randn(3, 2), cf_logits=torch.randn(3, 2), labels=torch.tensor([0, 1, 1]))
    args.update(kwargs)
    for backend in ("reference", "cpp"):
        if error is None:
            run(backend, crm_loss, **args)
            continue
        with pytest.raises(error) as caught:
            run(backend, crm_loss, **args)
        assert words in str(caught.value)
        if "ignore_index" not in args and "labels" not in kwargs:
            with pytest.raises(error) as caught:
                run(backend, crm_weights, args["logits"], args["cf_logits"], args.get("a1", 0.0), args.get("a2", 10.0))
            assert words in str(caught.value)


@pytest.mark.parametrize("clip", [(0.0, 10.0), (0.9, 1.2)], ids=["paper", "tight"])
def test_a_nan_counterfactual_row_gives_nan_as_the_reference(backend, device, clip):
    # A NaN counterfactual must reach the loss (and the Trainer's non-finite check), not become weight a1 (Triton's
    # minimum/maximum drop NaN unless told to propagate it: a CAT step with NaN counterfactuals trained as plain ERM).
    logits, cf_logits, labels = _inputs((5, 3), torch.float32, device, 0)
    cf_logits[2] = float("nan")
    for reduction in ("none", "mean"):
        want = run("reference", crm_loss, logits, cf_logits, labels, *clip, True, reduction)
        got = run(backend, crm_loss, logits, cf_logits, labels, *clip, True, reduction)
        torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-5, atol=1e-6)
        assert got.isnan().any()
    want_w = run("reference", crm_weights, logits, cf_logits, *clip)
    got_w = run(backend, crm_weights, logits, cf_logits, *clip)
    assert torch.equal(got_w.isnan(), want_w.isnan()) and bool(got_w[2].isnan())
