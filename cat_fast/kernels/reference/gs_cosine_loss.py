"""Gradient-supervision loss (docs/METHODS.md §2): per row 1 - cos(g_i, g_hat_i), norms clamped below at eps."""
import torch


def gs_cosine_loss(g, g_hat, reduction="mean", eps=1e-8):
    x = g.reshape(g.shape[0], -1)
    y = g_hat.reshape(g_hat.shape[0], -1)
    if x.dtype in (torch.float16, torch.bfloat16):
        x, y = x.float(), y.float()
    dot = (x * y).sum(1)
    norms = (x * x).sum(1).clamp_min(eps * eps).sqrt() * (y * y).sum(1).clamp_min(eps * eps).sqrt()
    losses = 1 - dot / norms
    if reduction == "mean":
        return losses.mean()
    if reduction == "sum":
        return losses.sum()
    return losses
