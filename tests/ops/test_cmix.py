import pytest
import torch

import cat_fast
from cat_fast.ops import cmix

from .conftest import assert_outputs_match, dtypes_for, noncontiguous, run, tolerance

SHAPES = [(1, 1, 1), (3, 5, 7), (4, 17, 64), (5, 3, 130)]


def _inputs(shape, dtype, device, per_token, partner_kind, seed):
    generator = torch.Generator().manual_seed(seed)
    batch, tokens, hidden = shape
    h = torch.randn(shape, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)
    lam_shape = (batch, tokens) if per_token else (batch,)
    lam = torch.rand(lam_shape, generator=generator, dtype=torch.float64).to(device=device, dtype=torch.float32 if dtype != torch.float64 else dtype)
    if partner_kind == "permutation":
        partner = torch.randperm(batch, generator=generator)
    else:
        partner = torch.randint(0, max(batch // 2, 1), (batch,), generator=generator)
    return h, lam, partner.to(device)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
@pytest.mark.parametrize("partner_kind", ["permutation", "repeats"])
def test_matches_reference(backend, device, shape, per_token, partner_kind):
    for seed, dtype in enumerate(dtypes_for(device)):
        h, lam, partner = _inputs(shape, dtype, device, per_token, partner_kind, seed)
        generator = torch.Generator().manual_seed(100 + seed)
        grad_out = torch.randn(h.shape, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)

        def outputs(which, h, lam, grad_out):
            h = h.detach().requires_grad_()
            lam = lam.detach().requires_grad_()
            out, _ = run(which, cmix, h, lam, partner)
            out.backward(grad_out)
            return out, h.grad, lam.grad

        truth = outputs("reference", h.double(), lam.double(), grad_out.double())
        lam_terms = shape[2] * (1 if per_token else shape[1])  # grad_lam sums over D (and T for per-sample λ)
        assert_outputs_match(
            ("h_mix", "grad_h", "grad_lam"), outputs(backend, h, lam, grad_out), outputs("reference", h, lam, grad_out), truth, dtype,
            terms={"grad_lam": lam_terms},
        )


def test_noncontiguous_inputs(backend, device):
    h, lam, partner = _inputs((4, 6, 8), torch.float32, device, True, "repeats", 7)
    expected, _ = run("reference", cmix, h, lam, partner)
    got, _ = run(backend, cmix, noncontiguous(h), noncontiguous(lam), noncontiguous(partner))
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("mode", ["self", "partner", "union", "intersection"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64])
def test_masks_with_all_padding_rows(backend, device, mode, mask_dtype):
    h, lam, partner = _inputs((4, 5, 3), torch.float32, device, False, "repeats", 3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=mask_dtype, device=device)
    partner = torch.tensor([1, 0, 3, 3], device=device)
    _, mask_mix = run(backend, cmix, h, lam, partner, mask, mode)
    mine, theirs = mask.bool(), mask.bool()[partner]
    expected = {"self": mine, "partner": theirs, "union": mine | theirs, "intersection": mine & theirs}[mode]
    assert mask_mix.dtype == mask_dtype
    assert torch.equal(mask_mix.bool(), expected)
    h_mix, _ = run(backend, cmix, h, lam, partner, mask, mode)
    assert torch.isfinite(h_mix).all()
    assert run(backend, cmix, h, lam, partner)[1] is None


def test_zero_and_one_lambda_select_rows(backend, device):
    h, _, partner = _inputs((5, 4, 6), torch.float32, device, False, "repeats", 11)
    zero, one = torch.zeros(5, device=device), torch.ones(5, device=device)
    torch.testing.assert_close(run(backend, cmix, h, zero, partner)[0], h)
    torch.testing.assert_close(run(backend, cmix, h, one, partner)[0], h[partner])


@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
def test_gradcheck_and_gradgradcheck(backend, device, per_token):
    if device != "cpu":
        pytest.skip("float64 gradcheck runs on the CPU")
    h, lam, partner = _inputs((3, 4, 5), torch.float64, device, per_token, "repeats", 5)
    h.requires_grad_()
    lam.requires_grad_()

    def fn(h, lam):
        return run(backend, cmix, h, lam, partner)[0]

    interpreted = backend == "triton"  # under the interpreter: random projections of the Jacobian (speed)
    assert torch.autograd.gradcheck(fn, (h, lam), fast_mode=interpreted)
    assert torch.autograd.gradgradcheck(fn, (h, lam), fast_mode=interpreted)


def test_opcheck(backend, device):
    h, lam, partner = _inputs((3, 4, 8), torch.float32, device, False, "repeats", 2)
    h.requires_grad_()
    kernels = cat_fast.ops.registry.kernels(backend)
    torch.library.opcheck(kernels.cmix_forward.default, (h, lam.requires_grad_(), partner))
    grad = torch.randn_like(h)
    torch.library.opcheck(kernels.cmix_backward.default, (grad, h.detach(), lam.detach(), partner))


def test_torch_compile_first_order(backend, device):
    h, lam, partner = _inputs((3, 4, 8), torch.float32, device, False, "repeats", 4)
    h.requires_grad_()

    def step(h, lam):
        with cat_fast.use_backend(backend):
            return cmix(h, lam, partner)[0].square().sum()

    compiled = torch.compile(step, fullgraph=False)
    loss = compiled(h, lam)
    (grad,) = torch.autograd.grad(loss, h)
    h_ref = h.detach().requires_grad_()
    loss_ref = run("reference", cmix, h_ref, lam, partner)[0].square().sum()
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref)
    torch.testing.assert_close(grad, h_ref.grad)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(h=torch.randn(2, 3)), ValueError, "h: expected a 3-D"),
        (dict(h=torch.randn(2, 3, 4, dtype=torch.float64).long()), TypeError, "h: expected dtype"),
        (dict(lam=torch.rand(3)), ValueError, "lam: expected size 2"),
        (dict(lam=torch.rand(2, 4)), ValueError, "lam: expected size 3"),
        (dict(partner=torch.tensor([0, 2])), ValueError, "partner: expected values in [0, 2)"),
        (dict(partner=torch.tensor([0, -1])), ValueError, "partner: expected values in [0, 2)"),
        (dict(partner=torch.tensor([0.0, 1.0])), TypeError, "partner: expected dtype"),
        (dict(partner=torch.tensor([0, 1, 1])), ValueError, "partner: expected shape (2,)"),
        (dict(mask=torch.ones(2, 4, dtype=torch.bool)), ValueError, "mask: expected shape (2, 3)"),
        (dict(mask=torch.ones(2, 3)), TypeError, "mask: expected a bool or integer"),
        (dict(mask_mode="both"), ValueError, "mask_mode: expected one of"),
        (dict(h=torch.randn(0, 3, 4)), ValueError, "h: expected at least one row"),
        (dict(lam=[0.5, 0.5]), TypeError, "lam: expected a torch.Tensor"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, words):
    args = dict(h=torch.randn(2, 3, 4), lam=torch.rand(2), partner=torch.tensor([1, 0]), mask=None, mask_mode="self")
    args.update(kwargs)
    for backend in ("reference", *[b for b in ("cpp",) if b in cat_fast.backends()]):
        with pytest.raises(error) as caught:
            run(backend, cmix, **args)
        assert words in str(caught.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tensors_on_different_devices():
    with pytest.raises(ValueError, match="partner: expected a tensor on cuda"):
        cmix(torch.randn(2, 3, 4, device="cuda"), torch.rand(2, device="cuda"), torch.tensor([1, 0]))


def _lam_forms(batch, tokens, generator):
    """(id, lam, its broadcast to [B, T, 1]) for every accepted form of lambda."""
    def rand(*shape):
        return torch.rand(shape, generator=generator, dtype=torch.float64)

    forms = [
        ("float", 0.3, lambda lam: torch.full((1, 1, 1), lam, dtype=torch.float64)),
        ("int", 1, lambda lam: torch.full((1, 1, 1), float(lam), dtype=torch.float64)),
        ("0-d", rand(), lambda lam: lam.reshape(1, 1, 1)),
        ("[1]", rand(1), lambda lam: lam.reshape(1, 1, 1)),
        ("[B]", rand(batch), lambda lam: lam.reshape(batch, 1, 1)),
        ("[B,1]", rand(batch, 1), lambda lam: lam[..., None]),
        ("[1,1]", rand(1, 1), lambda lam: lam[..., None]),
        ("[B,T]", rand(batch, tokens), lambda lam: lam[..., None]),
        ("[1,T]", rand(1, tokens), lambda lam: lam[..., None]),
        ("[B,T,1]", rand(batch, tokens, 1), lambda lam: lam),
        ("[1,T,1]", rand(1, tokens, 1), lambda lam: lam),
        ("[B,1,1]", rand(batch, 1, 1), lambda lam: lam),
    ]
    return forms


@pytest.mark.parametrize("shape", [(1, 1, 3), (4, 5, 8), (3, 7, 130)], ids=str)
def test_lambda_broadcast_forms_match_explicit_broadcast(backend, device, shape):
    """A number, a 0-d tensor and every shape that broadcasts to per-sample [B] or per-token [B, T] lambda give
    what the explicitly broadcast lambda gives, and the gradient of a tensor lambda comes back in its own shape."""
    batch, tokens, _ = shape
    for seed, dtype in enumerate(dtypes_for(device)):
        generator = torch.Generator().manual_seed(60 + seed)
        h = torch.randn(shape, generator=generator, dtype=torch.float64)
        partner = torch.randint(0, batch, (batch,), generator=generator).to(device)
        grad_out = torch.randn(shape, generator=generator, dtype=torch.float64)
        lam_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        for name, lam, broadcast in _lam_forms(batch, tokens, generator):
            # truth: the plain formula in float64 with torch broadcasting, autograd for the gradient of lam
            hd = h.to(dtype).double().requires_grad_()
            lam_t = lam.to(lam_dtype).double().requires_grad_() if isinstance(lam, torch.Tensor) else lam
            lam_btd = broadcast(lam_t)
            want = lam_btd * hd[partner.cpu()] + (1 - lam_btd) * hd
            want.backward(grad_out.to(dtype).double())

            x = h.to(device=device, dtype=dtype).requires_grad_()
            lam_in = lam.to(device=device, dtype=lam_dtype).requires_grad_() if isinstance(lam, torch.Tensor) else lam
            got, _ = run(backend, cmix, x, lam_in, partner)
            got.backward(grad_out.to(device=device, dtype=dtype))
            tol = tolerance(dtype)
            tol["atol"] *= max(1.0, (shape[1] * shape[2] / 64) ** 0.5)
            msg = lambda m: f"lam {name} {dtype}: {m}"  # noqa: E731
            assert got.dtype == dtype and got.shape == h.shape
            torch.testing.assert_close(got.double().cpu(), want.detach(), **tolerance(dtype), msg=msg)
            torch.testing.assert_close(x.grad.double().cpu(), hd.grad, **tolerance(dtype), msg=msg)
            if isinstance(lam, torch.Tensor):
                assert lam_in.grad.shape == lam.shape, name
                torch.testing.assert_close(lam_in.grad.double().cpu(), lam_t.grad, **tol, msg=msg)


@pytest.mark.parametrize("lam_shape", [(3, 1), (1, 2), (3, 2, 1), ()], ids=str)
def test_gradcheck_of_broadcast_lambda(backend, device, lam_shape):
    """gradcheck of h and a broadcast lambda (its gradient in its own shape); gradgradcheck for [B, 1] (every order
    goes through the same reshape/expand, and gradgradcheck is slow under the Triton interpreter)."""
    if device != "cpu":
        pytest.skip("float64 gradcheck runs on the CPU")
    h, _, partner = _inputs((3, 2, 3), torch.float64, device, False, "repeats", 8)
    lam = torch.rand(lam_shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    h.requires_grad_()
    lam.requires_grad_()

    def fn(h, lam):
        return run(backend, cmix, h, lam, partner)[0]

    assert torch.autograd.gradcheck(fn, (h, lam))
    if lam_shape == (3, 1):
        assert torch.autograd.gradgradcheck(fn, (h, lam))


@pytest.mark.parametrize(
    "lam, error, words",
    [
        (torch.rand(2, 4), ValueError, "per-feature [B, D] lambda is not supported"),  # [B, D], D != T
        (torch.rand(3, 1), ValueError, "lam: expected size 2 (or 1) in dim 0 (batch size B of h"),
        (torch.rand(1, 2), ValueError, "lam: expected size 3 (or 1) in dim 1 (sequence length T of h"),
        (torch.rand(2, 3, 4), ValueError, "lam: expected size 1 in dim 2"),
        (torch.rand(2, 3, 1, 1), ValueError, "lam: expected at most 3 dimensions"),
        (True, TypeError, "lam: expected a torch.Tensor or a number, got bool"),
        ("0.5", TypeError, "lam: expected a torch.Tensor or a number, got str"),
        (torch.tensor([1, 0]), TypeError, "lam: expected dtype"),
    ],
)
def test_lambda_shapes_that_do_not_broadcast(lam, error, words):
    h, partner = torch.randn(2, 3, 4), torch.tensor([1, 0])
    for backend in ("reference", *[b for b in ("cpp",) if b in cat_fast.backends()]):
        with pytest.raises(error) as caught:
            run(backend, cmix, h, lam, partner)
        assert words in str(caught.value)
        assert "lam may be a number" in str(caught.value) or error is TypeError
