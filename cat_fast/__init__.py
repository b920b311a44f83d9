"""cat_fast: fast, exact counterfactual and debiasing training for PyTorch text classifiers.

Packages: `ops` (fused ops), `kernels` (their reference and Triton backends), `layers` (fast encoder layers),
`models` (capture, resume, interventions on Hugging Face models), `objectives` (CAT, gradient supervision; a
registry by name), `distributed` (the objectives under DistributedDataParallel), `integrations` (Hugging Face Trainer classes), `data`, `analysis`, `cli`. README: Architecture.
"""
from . import ops
from .ops.backend import backends, use_backend

__version__ = "0.1.0"

__all__ = ["ops", "backends", "use_backend", "CAT", "GradientSupervision", "CLP", "CATTrainer", "GSTrainer",
           "Objective", "objectives", "distributed"]

_LAZY = {"CAT": "objectives", "GradientSupervision": "objectives", "CLP": "objectives", "Objective": "objectives",
         "CATTrainer": "integrations", "GSTrainer": "integrations"}


def __getattr__(name):
    # The objectives import transformers; keep `import cat_fast` light for users of the ops alone.
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(f"cat_fast.{_LAZY[name]}"), name)
    if name in ("objectives", "models", "layers", "integrations", "data", "analysis", "kernels", "cli", "bias", "distributed"):
        return importlib.import_module(f"cat_fast.{name}")
    raise AttributeError(f"module 'cat_fast' has no attribute {name!r}")
