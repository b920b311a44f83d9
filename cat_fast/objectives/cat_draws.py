"""The random draws of a CAT step — the mixing layer, the partners and λ — as a mixin of `cat.CAT`, which holds
``layers``, ``partner``, ``alpha``, ``beta``, ``generator`` and ``layer_generator`` (see `CAT` on randomness).
"""
from __future__ import annotations

import torch

__all__ = ["Draws"]


class Draws:
    """`CAT`'s draws: a CPU generator (``generator``, ``layer_generator`` for the layer) makes them reproducible;
    without one the layer and the partners come from the global CPU RNG and λ from the global RNG of the model's
    device (λ's Beta concentrations are kept per shape in ``_concentration``). The partners are drawn on the host
    (`_draw_host_partner`), where a captured step counts its packed rows from them without a synchronisation."""

    def _draw_layer(self):
        if len(self.layers) == 1:
            return self.layers[0]
        gen = self.layer_generator if self.layer_generator is not None else self.generator
        idx = torch.randint(len(self.layers), (1,), generator=gen)  # CPU: no device sync
        return self.layers[int(idx)]

    @staticmethod
    def _to(t, device):
        """`t` (a CPU tensor) on `device`; to a GPU from pinned memory, so that the copy does not wait for the GPU's
        queued work (a pageable one synchronises the stream first)."""
        if device.type != "cuda":
            return t.to(device)
        return t.pin_memory().to(device, non_blocking=True)

    def _draw_host_partner(self, B):
        """The partners of a batch of `B`, a CPU int64 tensor: a permutation, or `B` draws with replacement."""
        if self.partner == "permutation":
            return torch.randperm(B, generator=self.generator)
        return torch.randint(B, (B,), generator=self.generator)

    def _draw_partner(self, B, device):
        return self._to(self._draw_host_partner(B), device)

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
        return self._to(lam, device)
