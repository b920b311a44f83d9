"""The random draws of a CAT step — the mixing layer, the partners and λ — as a mixin of `cat.CAT`, which holds
``layers``, ``partner``, ``alpha``, ``beta``, ``generator`` and ``layer_generator`` (see `CAT` on randomness).
"""
from __future__ import annotations

import torch

__all__ = ["Draws"]


class Draws:
    """`CAT`'s draws: a CPU generator (``generator``, ``layer_generator`` for the layer) makes them reproducible;
    without one they come from the global RNG on the model's device (λ's Beta concentrations are kept per shape in
    ``_concentration``)."""

    def _draw_layer(self):
        if len(self.layers) == 1:
            return self.layers[0]
        gen = self.layer_generator if self.layer_generator is not None else self.generator
        idx = torch.randint(len(self.layers), (1,), generator=gen)  # CPU: no device sync
        return self.layers[int(idx)]

    def _draw_partner(self, B, device):
        gen = self.generator
        if self.partner == "permutation":
            if gen is not None:
                return torch.randperm(B, generator=gen).to(device, non_blocking=True)
            return torch.randperm(B, device=device)
        if gen is not None:
            return torch.randint(B, (B,), generator=gen).to(device, non_blocking=True)
        return torch.randint(B, (B,), device=device)

    def _draw_lambda(self, B, device, dtype):
        if self.generator is None:
            # Beta(α, β) as torch.distributions samples it (the first coordinate of a Dirichlet(α, β) draw: the
            # same kernel, the same random numbers) without building the distribution objects each step. The
            # concentrations are made with torch.full (no host-to-device copy, no sync) once per shape.
            key = (B, device, dtype)
            if self._concentration is None or self._concentration[0] != key:
                a = torch.full((B,), self.alpha, device=device, dtype=dtype)
                b = torch.full((B,), self.beta, device=device, dtype=dtype)
                self._concentration = (key, torch.stack([a, b], -1))
            return torch._sample_dirichlet(self._concentration[1]).select(-1, 0)
        seed = int(torch.randint(2**62, (1,), generator=self.generator))
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            lam = torch.distributions.Beta(torch.full((B,), self.alpha, dtype=dtype),
                                           torch.full((B,), self.beta, dtype=dtype)).sample()
        return lam.to(device, non_blocking=True)
