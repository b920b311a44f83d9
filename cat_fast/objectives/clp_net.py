"""CLP's perturbation network Ω and the classification head it perturbs (`cat_fast.objectives.clp`)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PerturbationNet", "find_head"]


class PerturbationNet(nn.Module):
    """Ω: BatchNorm(10) → Linear(10, hidden) → ReLU → Linear(hidden, 1) → tanh, times `scale`; [B, 10] → [B]."""

    def __init__(self, hidden: int = 100, scale: float = 1.0):
        super().__init__()
        self.norm = nn.BatchNorm1d(10)
        self.fc1 = nn.Linear(10, hidden)
        self.fc2 = nn.Linear(hidden, 1)
        self.scale = float(scale)

    def forward(self, x):
        return self.scale * torch.tanh(self.fc2(F.relu(self.fc1(self.norm(x))))).squeeze(-1)


def find_head(model, num_labels: Optional[int] = None) -> nn.Linear:
    """The classification head's last Linear: the last ``nn.Linear`` (in module order) whose output width is the
    number of labels."""
    n = num_labels or getattr(getattr(model, "config", None), "num_labels", None)
    found = None
    for module in model.modules():
        if isinstance(module, nn.Linear) and (n is None or module.out_features == n):
            found = module
    if found is None:
        raise ValueError(f"head: no nn.Linear with {n} outputs in {type(model).__name__}; pass head=")
    return found
