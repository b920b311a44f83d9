"""Which implementation of the ops runs: `reference`, `cpp`, `cuda` or `triton`.

Selection order: `use_backend(...)` context > `CAT_FAST_BACKEND` environment variable > the
default for the tensors' device (CPU: `cpp`, else `reference`; CUDA: `cuda`, measured faster than `triton` for
every op in benchmarks/RESULTS.md, else `triton`, else `reference`).
"""
import contextlib
import os
import threading

BACKENDS = ("reference", "cpp", "cuda", "triton")

_state = threading.local()


def triton_interpreted():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_AVAILABLE = []


def _available():
    # Fixed for the life of the process (what was built and imported); cached: it sits on every op's hot path.
    if not _AVAILABLE:
        _AVAILABLE.append(_find_available())
    return _AVAILABLE[0]


def _find_available():
    # Plain reads of what `registry` found at import, so that a first call inside torch.compile traces this.
    from . import registry

    found = ["reference"]
    if registry.cpp_loaded():
        found.append("cpp")
    if registry.cuda_kernels_built() and registry.has_cuda():
        found.append("cuda")
    if registry.triton_loaded():  # loaded only where Triton is installed and has CUDA or the interpreter
        found.append("triton")
    return tuple(found)


def backends():
    """The backends usable in this process (compiled, importable, and with a device to run on)."""
    return _available()


def _check_name(name):
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {name!r}")


@contextlib.contextmanager
def use_backend(name):
    """Run the ops inside the block on backend `name` (see `backends()`)."""
    _check_name(name)
    if name not in backends():
        raise ValueError(f"backend {name!r} is not available here; available: {backends()}")
    previous = getattr(_state, "name", None)
    _state.name = name
    try:
        yield
    finally:
        _state.name = previous


def requested():
    """The backend asked for by `use_backend` or CAT_FAST_BACKEND, or None for the default."""
    name = getattr(_state, "name", None)
    if name is None:
        name = os.environ.get("CAT_FAST_BACKEND") or None
        if name is not None:
            _check_name(name)
    return name


def _device_ok(name, device_type):
    if name == "reference":
        return True
    if name == "cpp":
        return device_type == "cpu"
    if name == "cuda":
        return device_type == "cuda"
    return device_type == "cuda" or (device_type == "cpu" and triton_interpreted())


def select(op, device):
    """The backend that runs `op` on tensors of `device`."""
    device_type = device.type
    name = requested()
    available = backends()
    if name is not None:
        if name not in available:
            raise ValueError(f"backend {name!r} is not available here; available: {available}")
        if not _device_ok(name, device_type):
            raise ValueError(f"backend {name!r} cannot run {op} on {device_type} tensors")
        return name
    if device_type == "cpu":
        return "cpp" if "cpp" in available else "reference"
    if device_type == "cuda":
        for candidate in ("cuda", "triton"):
            if candidate in available:
                return candidate
    return "reference"
