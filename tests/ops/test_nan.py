"""NaN in, NaN out, as in the reference: a fused op must not turn a NaN input into a finite output (a NaN step that
trains on as if nothing happened is silent garbage). Each op gets a NaN first in a row (where a row-max kernel
starts its running state), in the middle, or as the whole row; outputs and input gradients are compared with the
reference, NaN positions included."""
import pytest
import torch

from cat_fast.ops import cmix, gs_cosine_loss

from .conftest import run
from .test_bias_losses import LOSSES, call_loss, loss_inputs

PLACES = {"first": [0], "middle": [2], "row": [0, 1, 2, 3, 4]}


def _compare(got, want):
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-4, atol=1e-5)


def _outputs(which, fn, inputs, grad_index=0):
    x = [t.detach().clone().requires_grad_(i == grad_index) for i, t in enumerate(inputs)]
    out = run(which, fn, *x)
    (out.sum() if out.dim() else out).backward()
    return out.detach(), x[grad_index].grad


@pytest.mark.parametrize("name", [n for n in LOSSES if n in ("poe", "reweight", "learned-mixin", "conf-reg")])
@pytest.mark.parametrize("place", list(PLACES))
def test_bias_losses(backend, device, name, place):
    logits, bias, gate, teacher, labels = loss_inputs((4, 5), torch.float32, device, 0)
    logits[1, PLACES[place]] = float("nan")

    def outputs(which):
        z = logits.detach().clone().requires_grad_(True)
        out = call_loss(name, which, z, bias, gate, teacher, labels, "none" if name != "reweight" else None)
        out.sum().backward()
        return out.detach(), z.grad

    want = outputs("reference")
    got = outputs(backend)
    assert got[0].isnan().any()
    for g, w in zip(got, want):
        _compare(g, w)


@pytest.mark.parametrize("place", list(PLACES))
def test_gs_cosine_loss(backend, device, place):
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(3, 5, generator=gen).to(device)
    g_hat = torch.randn(3, 5, generator=gen).to(device)
    g[1, PLACES[place]] = float("nan")
    want = _outputs("reference", lambda a, b: gs_cosine_loss(a, b, reduction="none"), [g, g_hat])
    got = _outputs(backend, lambda a, b: gs_cosine_loss(a, b, reduction="none"), [g, g_hat])
    assert bool(got[0][1].isnan())
    for x, w in zip(got, want):
        _compare(x, w)


@pytest.mark.parametrize("place", list(PLACES))
def test_cmix(backend, device, place):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(3, 4, 5, generator=gen).to(device)
    lam = torch.rand(3, generator=gen).to(device)
    partner = torch.tensor([1, 2, 0], device=device)
    h[1, 2, PLACES[place]] = float("nan")
    want = _outputs("reference", lambda a, b: cmix(a, b, partner)[0], [h, lam])
    got = _outputs(backend, lambda a, b: cmix(a, b, partner)[0], [h, lam])
    assert got[0].isnan().any()
    for x, w in zip(got, want):
        _compare(x, w)
