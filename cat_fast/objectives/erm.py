"""ERM: the model's own loss (cross-entropy for sequence classifiers), as an objective."""
from __future__ import annotations

from .base import Objective

__all__ = ["ERM"]

# batch keys that are cat_fast metadata, not arguments of the model's forward
_METADATA = ("pairs", "pair_group", "context_mask")


class ERM(Objective):
    """``loss, info = ERM(model)(batch)``: ``model(**batch).loss`` (labels in the batch); ``info`` is empty."""

    def __call__(self, batch, pairs=None):
        self.step += 1
        inputs = {k: v for k, v in batch.items() if k not in _METADATA}
        return self.model(**inputs).loss, {}
