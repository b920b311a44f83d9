"""Loads the kernel ops of each backend and registers their fake (meta) implementations and autograd.

Native kernels (cpp on CPU, cuda on CUDA) are `torch.ops.cat_fast.<name>` from the compiled
extension, whose schemas are in csrc/ops.cpp. Triton kernels are the same schemas registered here
as `torch.ops.cat_fast.<name>_triton`. `SCHEMAS` mirrors csrc/ops.cpp (a test keeps them equal).
"""
import importlib
import importlib.util
import os

import torch

SCHEMAS = {
    "cmix_forward": "(Tensor h, Tensor lam, Tensor partner) -> Tensor",
    "cmix_backward": "(Tensor grad, Tensor h, Tensor lam, Tensor partner) -> (Tensor, Tensor)",
    "cal_objective_forward": "(Tensor logits, Tensor labels, float gamma, float eta) -> Tensor",
    "cal_objective_backward": "(Tensor grad, Tensor logits, Tensor labels, float gamma, float eta) -> Tensor",
    "cal_step_": "(Tensor(a!) lam, Tensor grad, float lr, float p, float lo, float hi) -> ()",
    "crm_loss_forward": "(Tensor logits, Tensor cf_logits, Tensor labels, float a1, float a2, int reduction, bool detach_weight) -> (Tensor, Tensor)",
    "crm_loss_backward": "(Tensor grad, Tensor logits, Tensor cf_logits, Tensor labels, Tensor stats, float a1, float a2, int reduction, bool detach_weight) -> (Tensor, Tensor)",
    "gs_row_dots": "(Tensor x, Tensor y) -> Tensor",
    "gs_row_combine": "(Tensor x, Tensor y, Tensor coef) -> (Tensor, Tensor)",
}

# Kernel op -> module of cat_fast.triton that holds its launcher (a function of the same name).
TRITON_MODULES = {
    "cmix_forward": "cmix",
    "cmix_backward": "cmix",
    "cal_objective_forward": "cal_objective",
    "cal_objective_backward": "cal_objective",
    "cal_step_": "cal_step",
    "crm_loss_forward": "crm_loss",
    "crm_loss_backward": "crm_loss",
    "gs_row_dots": "gs_cosine_loss",
    "gs_row_combine": "gs_cosine_loss",
}

_load_errors = {}


def _load_cpp():
    try:
        importlib.import_module("cat_fast._C")
        return True
    except ImportError as error:
        _load_errors["cpp"] = str(error)
        return False


_CPP = _load_cpp()


def cpp_loaded():
    return _CPP


def cuda_kernels_built():
    return _CPP and torch._C._dispatch_has_kernel_for_dispatch_key("cat_fast::cmix_forward", "CUDA")


def _triton_usable():
    if importlib.util.find_spec("triton") is None:
        _load_errors["triton"] = "triton is not installed"
        return False
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        _load_errors["triton"] = "no CUDA device (set TRITON_INTERPRET=1 to run Triton on the CPU)"
        return False
    return True


def _void(launcher):
    def run(*args):
        launcher(*args)

    return run


def _define_triton_ops():
    library = torch.library.Library("cat_fast", "FRAGMENT")
    for name, schema in SCHEMAS.items():
        module = importlib.import_module(f"cat_fast.triton.{TRITON_MODULES[name]}")
        launcher = getattr(module, name)
        if schema.endswith("-> ()"):
            launcher = _void(launcher)
        library.define(f"{name}_triton{schema}")
        for key in ("CUDA", "CPU"):
            library.impl(f"{name}_triton", launcher, key)
    return library


def _load_triton():
    if not _triton_usable():
        return None
    try:
        return _define_triton_ops()
    except Exception as error:  # a broken triton install must not break `import cat_fast`
        _load_errors["triton"] = f"{type(error).__name__}: {error}"
        return None


_TRITON_LIBRARY = _load_triton()


def triton_loaded():
    return _TRITON_LIBRARY is not None


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


def _variants():
    found = []
    if _CPP:
        found.append(NATIVE)
    if _TRITON_LIBRARY is not None:
        found.append(TRITON)
    return found


def register(name, fake, backward=None, setup_context=None):
    """Register the fake implementation (and autograd, if given) of kernel op `name` for every loaded backend.

    `backward` is a factory: `backward(kernels)` returns the backward function for that backend family.
    """
    for family in _variants():
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


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32
