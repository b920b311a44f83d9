"""cat_fast: fast, exact counterfactual and debiasing training for PyTorch text classifiers.

Ops (`cat_fast.ops`): cmix, cal_objective, cal_step_, crm_loss, crm_weights, gs_cosine_loss —
each with `reference`, `cpp`, `cuda` and `triton` backends (`backends()`, `use_backend()`).
Objectives: `CAT` (counterfactual adversarial training) and `GradientSupervision`; Hugging Face
trainers `CATTrainer`, `GSTrainer`.
"""
from . import ops
from ._backend import backends, use_backend

__version__ = "0.1.0"

__all__ = ["ops", "backends", "use_backend", "CAT", "GradientSupervision", "CATTrainer", "GSTrainer"]

_LAZY = {"CAT": "cat", "GradientSupervision": "gs", "CATTrainer": "trainer", "GSTrainer": "trainer"}


def __getattr__(name):
    # The objectives import transformers; keep `import cat_fast` light for users of the ops alone.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"cat_fast.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'cat_fast' has no attribute {name!r}")
