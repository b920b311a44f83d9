"""The effects of a mediation sweep (`mediation.neuron_effects`): one tensor of effects per (layer, component),
with the views the paper reads (`top`, `random`, `counts`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch

from .. import models

__all__ = ["Key", "NeuronEffects", "rank"]

Key = Tuple[int, str]  # (layer 1..L, component)


def rank(comp) -> int:
    """The position of component `comp` in `models.COMPONENTS` (forward order; unknown names last)."""
    return models.COMPONENTS.index(comp) if comp in models.COMPONENTS else len(models.COMPONENTS)


@dataclass
class NeuronEffects:
    """Per (layer, component): a float32 tensor [width] of effects (NIE), on the CPU."""

    effects: Dict[Key, torch.Tensor] = field(default_factory=dict)
    target_class: int = 0
    n_samples: int = 0

    def flat(self) -> Tuple[torch.Tensor, List[Tuple[int, str, int]]]:
        """All effects as one vector and the (layer, component, neuron) of each entry."""
        values, names = [], []
        for (layer, comp), v in sorted(self.effects.items(), key=lambda kv: (kv[0][0], rank(kv[0][1]))):
            values.append(v)
            names.extend((layer, comp, i) for i in range(v.numel()))
        return (torch.cat(values) if values else torch.empty(0)), names

    def top(self, k: int, by: str = "value") -> List[Tuple[int, str, int, float]]:
        """The k neurons with the largest effect (``by="abs"``: largest |effect|)."""
        values, names = self.flat()
        score = values.abs() if by == "abs" else values
        k = min(int(k), values.numel())
        idx = torch.topk(score, k).indices.tolist()
        return [(*names[i], float(values[i])) for i in idx]

    def random(self, k: int, seed: int = 0) -> List[Tuple[int, str, int, float]]:
        """k neurons drawn uniformly without replacement (a seeded CPU generator): the paper's "without CMA"
        control, in the format of `top`."""
        values, names = self.flat()
        k = min(int(k), values.numel())
        idx = torch.randperm(values.numel(), generator=torch.Generator().manual_seed(int(seed)))[:k].tolist()
        return [(*names[i], float(values[i])) for i in idx]

    def counts(self, k: int) -> Dict[Key, int]:
        """How many of the top-k neurons sit in each (layer, component): the paper's figure."""
        out: Dict[Key, int] = {}
        for layer, comp, _, _ in self.top(k):
            out[(layer, comp)] = out.get((layer, comp), 0) + 1
        return out
