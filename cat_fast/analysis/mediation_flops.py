"""The matmul FLOPs of a mediation sweep (`mediation.neuron_effects`), fast and stacked paths: `sweep_flops`."""
from __future__ import annotations

import torch

from .. import models
from ..models import families

__all__ = ["sweep_flops"]


def sweep_flops(config, lengths, layers=None, components=models.COMPONENTS, *, first_token: bool = True,
                fast: bool = True) -> int:
    """The matmul FLOPs of `neuron_effects` in the encoder layers (the head's left out): projections, feed-forward
    and attention (``QKᵀ`` and ``AV``: 4·t·D per query row over t keys) for samples of these lengths (each sample's
    padded length in its batch; its real length for the floor), the `layers` and `components` swept.

    Per sample of length t (D the width, I the feed-forward width, P = 2D², F = 4DI, A(r) = 4·r·t·D, a whole
    layer W = t(4P + F) + A(t), a first-token layer W₁ = 2tP + 2P + F + A(1), the last layer Λ = W₁ with
    `first_token` (the model's head reads row 0 only, `models.first_token_ready`), else W):

    * clean forwards: L·W for the probabilities, and L·W per layer swept (the capture that records layers ℓ and
      ℓ + 1, or the input of layer ℓ for ``fast=False``);
    * ``fast=False`` (every copy resumes at layer ℓ): per neuron of layer ℓ, (L − ℓ)·W + Λ;
    * ``fast=True``, per neuron of layer ℓ: in layer ℓ, output 0, intermediate F/2 (its output projection),
      attention_output F, query P + F + A(1) (row 0 only), key / value t(P + F) + A(t) (no projections; with ℓ = L
      and `first_token`: P + F + A(1)); in layer ℓ + 1, after a row-0 edit 3P + t(P + F) + A(t) (the projections of
      row 0 only; with ℓ + 1 = L and `first_token`: 4P + F + A(1)), after a key / value edit W (W₁ when ℓ + 1 = L
      and `first_token`); layers ℓ + 2 .. L as the stacked path: (L − ℓ − 2)·W + Λ when ℓ + 2 ≤ L.
    """
    D = int(config.hidden_size)
    inner = families.inner_size(config)  # the family's config attribute (`Layout.inner_size`)
    if inner is None:
        names = sorted({spec.inner_size for spec in families.LAYOUTS.values()})
        raise ValueError(f"config: expected the feed-forward width ({' or '.join(names)})")
    I, L = int(inner), int(config.num_hidden_layers)  # noqa: E741
    layers = range(1, L + 1) if layers is None else layers
    P, Fw = 2 * D * D, 4 * D * I
    total = 0
    for t in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths):
        t = int(t)

        def A(rows):
            return 4 * rows * t * D

        W = t * (4 * P + Fw) + A(t)
        W1 = 2 * t * P + 2 * P + Fw + A(1)
        last = W1 if first_token else W
        total += L * W
        for layer in layers:
            total += L * W
            for comp in components:
                width = I if comp == "intermediate" else D
                if not fast:
                    total += width * ((L - layer) * W + last)
                    continue
                rest = (L - layer - 2) * W + last if layer + 2 <= L else 0
                if comp in ("key", "value"):
                    own = P + Fw + A(1) if layer == L and first_token else t * (P + Fw) + A(t)
                    nxt = 0 if layer == L else (W1 if layer + 1 == L and first_token else W)
                else:
                    own = {"output": 0, "intermediate": Fw // 2, "attention_output": Fw,
                           "query": P + Fw + A(1)}[comp]
                    if layer == L:
                        nxt = 0
                    elif layer + 1 == L and first_token:
                        nxt = 4 * P + Fw + A(1)
                    else:
                        nxt = 3 * P + t * (P + Fw) + A(t)
                total += width * (own + nxt + rest)
    return total
