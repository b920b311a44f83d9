"""Shared parametrisation of the op suites: every fused backend on every device it runs on, against `reference`."""
import pytest
import torch

import cat_fast

FUSED = ("cpp", "cuda", "triton")


def _cases():
    available = cat_fast.backends()
    cases = []
    for backend in FUSED:
        for device in ("cpu", "cuda"):
            runs = cat_fast.ops.backend._device_ok(backend, device)
            reason = None
            if device == "cuda" and not torch.cuda.is_available():
                reason = "no CUDA device"
            elif backend not in available:
                reason = f"backend {backend} not available: {cat_fast.ops.registry.load_errors().get(backend, 'not built')}"
            if runs:
                marks = [pytest.mark.skip(reason=reason)] if reason else []
                cases.append(pytest.param((backend, device), id=f"{backend}-{device}", marks=marks))
    return cases


@pytest.fixture(params=_cases())
def backend_device(request):
    return request.param


@pytest.fixture
def backend(backend_device):
    return backend_device[0]


@pytest.fixture
def device(backend_device):
    return backend_device[1]


def tolerance(dtype):
    return {
        torch.float64: dict(rtol=1e-10, atol=1e-10),
        torch.float32: dict(rtol=1e-5, atol=1e-5),
        torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
        torch.float16: dict(rtol=2e-3, atol=2e-3),
    }[dtype]


def dtypes_for(device):
    return (torch.float64, torch.float32, torch.bfloat16) if device == "cpu" else (torch.float32, torch.bfloat16, torch.float16)


def run(backend, fn, *args, **kwargs):
    with cat_fast.use_backend(backend):
        return fn(*args, **kwargs)


def noncontiguous(x):
    """The same values in a non-contiguous layout (a transposed copy transposed back)."""
    if x.dim() < 2:
        return torch.stack((x, x), -1)[..., 0]
    return x.transpose(0, -1).contiguous().transpose(0, -1)


def without_ties(logits):
    """Lift each row's maximum clear of the runner-up: with tied maxima, max-softmax has many subgradients
    (the kernels take the first index, torch.amax splits the gradient), and bf16 rounding makes ties common."""
    top = logits.argmax(-1, keepdim=True)
    return logits.scatter_add(-1, top, torch.full_like(top, 0.5, dtype=logits.dtype))


def with_ignored(labels, pattern, ignore_index=-100):
    """A copy of `labels` with ``ignore_index`` in no row (``"none"``), in row 0 and every third row (``"some"``) or
    in every row (``"all"``)."""
    labels = labels.clone()
    if pattern == "some":
        labels[::3] = ignore_index
    elif pattern == "all":
        labels[:] = ignore_index
    return labels


def assert_outputs_match(names, got, same_dtype, truth, dtype, terms=None):
    """Each output has the dtype the reference gives at the same input dtype, and the value of the reference
    computed in float64 from the same (rounded) inputs: in bf16/fp16 the eager reference itself rounds
    intermediates, while the kernels accumulate in fp32 and round once.

    `terms` maps an output name to the number of products each of its elements sums (a reduction): the rounding
    error of such a sum grows like sqrt(terms), so its absolute tolerance is scaled by sqrt(terms / 64) (the
    base tolerances suit sums of up to ~64 terms)."""
    for name, g, e, t in zip(names, got, same_dtype, truth):
        assert g.dtype == e.dtype and g.shape == e.shape, name
        tol = dict(tolerance(dtype))
        if terms and name in terms:
            tol["atol"] *= max(1.0, (terms[name] / 64) ** 0.5)
        torch.testing.assert_close(g.double(), t.double(), **tol, msg=lambda m: f"{name} {dtype}: {m}")
