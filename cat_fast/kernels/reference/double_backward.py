"""The backward of LayerNorm's and GELU's backward in PyTorch ops: the formulas of
`cat_fast.kernels.triton.double_backward` (its docstring derives them), with the same arguments and results."""
import math

import torch

__all__ = ["reference_layer_norm", "reference_gelu"]


def reference_layer_norm(x, weight, dy, a, c, e, mean, rstd):
    """``(g_x, g_w, g_dy)``: `double_backward.layer_norm` in PyTorch ops."""
    D = weight.numel()
    acc = torch.promote_types(x.dtype, torch.float32)
    x2, dy2, a2 = (t.to(acc).reshape(-1, D) for t in (x, dy, a))
    w, c, e = (t.to(acc).reshape(-1) for t in (weight, c, e))
    rstd = rstd.to(acc).reshape(-1, 1)
    x_hat = (x2 - mean.to(acc).reshape(-1, 1)) * rstd
    g = dy2 * w
    a_mean, ax_mean = a2.mean(1, keepdim=True), (a2 * x_hat).mean(1, keepdim=True)
    g_mean, gx_mean = g.mean(1, keepdim=True), (g * x_hat).mean(1, keepdim=True)
    r_pa = rstd * (a2 - a_mean - x_hat * ax_mean)
    a_dx = rstd * ((a2 * g).sum(1, keepdim=True) - D * (a_mean * g_mean + ax_mean * gx_mean))
    h = c * dy2 - rstd * (a2 * gx_mean + ax_mean * g)
    g_x = rstd * (h - h.mean(1, keepdim=True) - x_hat * (h * x_hat).mean(1, keepdim=True)) - a_dx * rstd * x_hat / D
    g_dy = w * r_pa + c * x_hat + e
    return g_x.to(x.dtype).view(x.shape), (dy2 * r_pa).sum(0), g_dy.to(dy.dtype).view(dy.shape)


def reference_gelu(x, dy, a):
    """``(g_x, g_dy)``: `double_backward.gelu` in PyTorch ops."""
    acc = torch.promote_types(x.dtype, torch.float32)
    x2, dy2, a2 = (t.to(acc) for t in (x, dy, a))
    cdf = 0.5 * (1.0 + torch.erf(x2 * math.sqrt(0.5)))
    pdf = torch.exp(-0.5 * x2 * x2) / math.sqrt(2.0 * math.pi)
    return (a2 * dy2 * pdf * (2.0 - x2 * x2)).to(x.dtype), (a2 * (cdf + x2 * pdf)).to(dy.dtype)
