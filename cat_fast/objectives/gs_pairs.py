"""The pairs of gradient supervision (`gs`): ``pairs[i]`` the index in the batch of sample i's counterfactual, −1
for none. `pair_by_group` builds them from group ids, `random_pairs` draws the paper's random-partner ablation,
`check_pairs` checks given ones, and `masked_mean` averages a per-sample loss over the paired rows.
"""
from __future__ import annotations

import os

import torch

__all__ = ["pair_by_group", "random_pairs", "check_pairs", "masked_mean"]

_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def pair_by_group(group_ids: torch.Tensor) -> torch.Tensor:
    """Pairs from group ids [B]: each sample's partner is the next sample (cyclically, in batch order) with the
    same id, -1 when alone. Groups of two give the symmetric pairing (i ↔ j). No host synchronisation."""
    ids = group_ids.reshape(-1)
    B = ids.shape[0]
    idx = torch.arange(B, device=ids.device)
    same = ids[:, None] == ids[None, :]
    same.fill_diagonal_(False)
    dist = (idx[None, :] - idx[:, None]) % B  # distance forward from i to j
    dist = torch.where(same, dist, torch.full_like(dist, B))
    best = dist.min(dim=1).values
    return torch.where(best < B, (idx + best) % B, torch.full_like(idx, -1))


def random_pairs(B, device, generator):
    """A random other sample as each sample's partner (none in a batch of one); `generator` a CPU generator or
    None (the global RNG on `device`)."""
    if B < 2:
        return torch.full((B,), -1, dtype=torch.long, device=device)
    if generator is not None:
        shift = torch.randint(1, B, (B,), generator=generator).to(device, non_blocking=True)
    else:
        shift = torch.randint(1, B, (B,), device=device)
    return (torch.arange(B, device=device) + shift) % B


def check_pairs(pairs, batch_size):
    """``pairs`` must be an integer tensor [B] of partner indices in [-1, B) (-1: none). The range is read on CPU
    tensors, and on CUDA only with CAT_FAST_DEBUG=1 (it would synchronise the host with the device)."""
    if not isinstance(pairs, torch.Tensor):
        raise TypeError(f"pairs: expected an integer torch.Tensor of partner indices [B], got {type(pairs).__name__}")
    if pairs.dtype not in _INDEX_DTYPES:
        raise TypeError(f"pairs: expected an integer tensor (partner indices, -1 = none), got dtype "
                        f"{str(pairs.dtype).replace('torch.', '')}")
    if tuple(pairs.shape) != (batch_size,):
        raise ValueError(f"pairs: expected shape ({batch_size},) (one partner index per sample of the batch), got "
                         f"{tuple(pairs.shape)}")
    if pairs.numel() and (pairs.device.type == "cpu" or os.environ.get("CAT_FAST_DEBUG", "0") == "1") \
            and not torch.compiler.is_compiling():
        low, high = int(pairs.min()), int(pairs.max())
        if low < -1 or high >= batch_size:
            raise ValueError(f"pairs: expected partner indices in [-1, {batch_size}) (-1 = no partner), got values "
                             f"in [{low}, {high}]")


def masked_mean(values, valid):
    """Mean of `values` over `valid` rows (0 when none), without a host synchronisation."""
    w = valid.to(values.dtype)
    return (values * w).sum() / w.sum().clamp_min(1)
