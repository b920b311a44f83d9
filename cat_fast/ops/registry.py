"""How a fused op's kernels are registered: one `define` entry per op, then its fake and autograd formulas.

An op `<op>` has kernel ops (its forward, its backward, ...) whose schemas are defined in C++ beside the CPU kernel
(`csrc/cpu/<op>.cpp`, ``TORCH_LIBRARY_FRAGMENT``; CUDA kernel in `csrc/cuda/<op>.cu`). Its Python module in
`cat_fast.ops` makes ONE entry::

    KERNELS = registry.define({"<op>_forward": "(Tensor x) -> Tensor", ...}, triton="<op>")

which records the schemas (a test checks them against the C++ ones) and, when Triton can run, defines the same
schemas as ``torch.ops.cat_fast.<name>_triton`` with the launchers of `cat_fast.kernels.triton.<op>` (functions named
like the kernel ops). `register` then gives every loaded variant its fake implementation and autograd.
"""
import importlib
import importlib.util
import os

import torch

from ..kernels.dtypes import acc_dtype

__all__ = ["SCHEMAS", "define", "register", "not_twice_differentiable", "kernels", "cpp_loaded",
           "cuda_kernels_built", "has_cuda", "triton_loaded", "load_errors", "acc_dtype"]

SCHEMAS = {}  # kernel op name -> schema (without the name), filled by `define`

_load_errors = {}


def _load_cpp():
    try:
        importlib.import_module("cat_fast._C")
        return True
    except ImportError as error:
        _load_errors["cpp"] = str(error)
        return False


_CPP = _load_cpp()
# Read once here, not on the first op call: that call may be inside torch.compile, which cannot trace these queries.
_CUDA_KERNELS = _CPP and torch._C._dispatch_has_kernel_for_dispatch_key("cat_fast::cmix_forward", "CUDA")
_HAS_CUDA = torch.cuda.is_available()


def cpp_loaded():
    return _CPP


def cuda_kernels_built():
    return _CUDA_KERNELS


def has_cuda():
    """Whether this process sees a CUDA device (read at import)."""
    return _HAS_CUDA


def _triton_usable():
    if importlib.util.find_spec("triton") is None:
        _load_errors["triton"] = "triton is not installed"
        return False
    if not _HAS_CUDA and os.environ.get("TRITON_INTERPRET", "0") != "1":
        _load_errors["triton"] = "no CUDA device (set TRITON_INTERPRET=1 to run Triton on the CPU)"
        return False
    return True


_TRITON = {"usable": _triton_usable(), "library": None}


def _void(launcher):
    def run(*args):
        launcher(*args)

    return run


def define(schemas, triton=None):
    """Record the kernel ops `schemas` ({name: "(args) -> returns"}) of one op; define their Triton variants from
    the launchers of `cat_fast.kernels.triton.<triton>` when Triton can run here. Returns nothing: call the kernels
    through `kernels(backend)`."""
    for name in schemas:
        if name in SCHEMAS:
            raise ValueError(f"kernel op {name!r} is defined twice")
    SCHEMAS.update(schemas)
    if triton is None or not _TRITON["usable"]:
        return
    try:
        module = importlib.import_module(f"cat_fast.kernels.triton.{triton}")
        if _TRITON["library"] is None:
            _TRITON["library"] = torch.library.Library("cat_fast", "FRAGMENT")
        library = _TRITON["library"]
        for name, schema in schemas.items():
            launcher = getattr(module, name)
            if schema.endswith("-> ()"):
                launcher = _void(launcher)
            library.define(f"{name}_triton{schema}")
            for key in ("CUDA", "CPU"):
                library.impl(f"{name}_triton", launcher, key)
    except Exception as error:  # a broken triton install must not break `import cat_fast`
        _load_errors["triton"] = f"{type(error).__name__}: {error}"
        _TRITON["usable"] = False


def triton_loaded():
    return _TRITON["usable"] and _TRITON["library"] is not None


def load_errors():
    """Why a backend is missing, by backend name."""
    return dict(_load_errors)


class Kernels:
    """The kernel ops of one backend family: `Kernels("").cmix_forward` is torch.ops.cat_fast.cmix_forward."""

    def __init__(self, suffix):
        self.suffix = suffix

    def __getattr__(self, name):
        return getattr(torch.ops.cat_fast, name + self.suffix)


NATIVE = Kernels("")
TRITON = Kernels("_triton")


def kernels(backend):
    return TRITON if backend == "triton" else NATIVE


def _variants(name):
    found = []
    if _CPP:
        found.append(NATIVE)
    if triton_loaded() and hasattr(torch.ops.cat_fast, f"{name}_triton"):
        found.append(TRITON)
    return found


def register(name, fake, backward=None, setup_context=None):
    """Register the fake implementation (and autograd, if given) of kernel op `name` for every loaded backend.

    `backward` is a factory: `backward(kernels)` returns the backward function for that backend family.
    """
    for family in _variants(name):
        qualname = f"cat_fast::{name}{family.suffix}"
        torch.library.register_fake(qualname)(fake)
        if backward is not None:
            torch.library.register_autograd(qualname, backward(family), setup_context=setup_context)


def not_twice_differentiable(op_name):
    """Backward factory for a backward kernel whose own derivative is not implemented: raise, never drop terms."""

    def factory(_family):
        def backward(ctx, *grads):
            raise RuntimeError(f"{op_name}: double backward is not supported (only first derivatives are)")

        return backward

    return factory
