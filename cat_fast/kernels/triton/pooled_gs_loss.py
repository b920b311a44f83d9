"""Gradient supervision on the pooled representation with a linear head, counterfactual target, in one kernel
launch (for `cat_fast.objectives.gs`, exact mode).

With logits ``x W^T + b``, the input-gradient of the partner's logit is ``g_i = W[y_j]`` (``j = pairs[i]``), so
the loss needs no double backward: ``L = Σ_i w_i (1 − cos(g_i, x_j − x_i))`` over the rows whose partner exists
and has another label (``w_i = 1 / count``; ``L = 0`` when ``count = 0``), and its only parameter gradient is
``∂L/∂W[c] = Σ_{i: y_j = c} w_i · ∂(−cos)/∂g_i``. `_kernel` computes L, the count and ∂L/∂W in one launch (one
program per class row of W, ``x`` read once per row); `pooled_gs_loss` wraps it as an autograd function whose
backward is one multiply. At a batch's pooled [B, D] the work is microseconds; what it saves is the host time of
the ~45 small ops (and their autograd nodes) of the composite, which a small-batch training step waits for.

The arithmetic is that of the composite in `cat_fast.kernels.reference.pooled_gs_loss`: ``g`` and ``x_j − x_i`` rounded to
x's dtype (as autograd's ``g`` and the 16-bit difference are), cosine as in ``F.cosine_similarity`` (each norm
clamped below at eps), and each row's gradient rounded to x's dtype before it is summed into its class row (as
the casts' backward rounds it).
"""
import torch
import triton
import triton.language as tl

from ..reference import pooled_gs_loss as _reference
from ._common import pow2_at_least

__all__ = ["pooled_gs_loss", "supported", "reference"]

MAX_WIDTH = 16384


@triton.jit
def _pair(pairs_ptr, labels_ptr, i):
    """(partner j ≥ 0, its label, whether row i has a counterfactual partner)."""
    j = tl.load(pairs_ptr + i)
    partner = tl.maximum(j, 0)
    partner_label = tl.load(labels_ptr + partner)
    valid = (j >= 0) & (partner_label != tl.load(labels_ptr + i))
    return partner, partner_label, valid


@triton.jit
def _kernel(x_ptr, weight_ptr, pairs_ptr, labels_ptr, loss_ptr, count_ptr, grad_w_ptr, B, D, stride_x, stride_w,
            eps, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    dtype = x_ptr.dtype.element_ty
    count = 0.0
    for i in range(B):
        _, _, valid = _pair(pairs_ptr, labels_ptr, i)
        count += valid.to(tl.float32)
    w = 1.0 / tl.maximum(count, 1.0)
    g = tl.load(weight_ptr + c * stride_w + cols, mask=inside, other=0.0).to(dtype).to(tl.float32)
    g_norm_raw = tl.sqrt(tl.sum(g * g, axis=0))
    g_norm = tl.maximum(g_norm_raw, eps)
    grad = tl.zeros([BLOCK], dtype=tl.float32)
    loss = 0.0
    for i in range(B):
        partner, partner_label, valid = _pair(pairs_ptr, labels_ptr, i)
        mine = valid & (partner_label == c)
        if mine | (valid & (c == 0)):  # program 0 sums the loss over every row
            x_i = tl.load(x_ptr + i * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
            x_j = tl.load(x_ptr + partner * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
            h = (x_j - x_i).to(dtype).to(tl.float32)
            h_norm = tl.maximum(tl.sqrt(tl.sum(h * h, axis=0)), eps)
            g_row = g
            g_row_norm = g_norm
            if partner_label != c:
                g_row = tl.load(weight_ptr + partner_label * stride_w + cols, mask=inside, other=0.0)
                g_row = g_row.to(dtype).to(tl.float32)
                g_row_norm = tl.maximum(tl.sqrt(tl.sum(g_row * g_row, axis=0)), eps)
            cos = tl.sum((g_row / g_row_norm) * (h / h_norm), axis=0)
            loss += w * (1.0 - cos)
            if mine:
                # d(−w cos)/dg = −w h / (|g| |h|) + w cos g / (|g| |g|_raw)  (the clamp is not differentiated)
                a = -w / (g_norm * h_norm)
                b = w * cos / (g_norm * tl.where(g_norm_raw > 0, g_norm_raw, 1.0))  # g = 0: cos = 0, so b = 0
                grad += (a * h + b * g).to(dtype).to(tl.float32)
    tl.store(grad_w_ptr + c * D + cols, grad.to(grad_w_ptr.dtype.element_ty), mask=inside)  # contiguous [C, D]
    if c == 0:
        tl.store(loss_ptr, loss)
        tl.store(count_ptr, count)


def supported(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: one CUDA device, x [B, D] in 16 or 32 bits, W [C, D] in floating
    point up to 32 bits, D ≤ MAX_WIDTH (float64 and wider rows run the composite)."""
    small = (torch.float32, torch.bfloat16, torch.float16)
    return (x.is_cuda and weight.device == x.device and x.dim() == 2 and weight.dim() == 2
            and x.shape[1] == weight.shape[1] <= MAX_WIDTH and x.dtype in small and weight.dtype in small)


def _launch(weight, x, pairs, labels, eps):
    B, D = x.shape
    C = weight.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    loss = torch.empty((), device=x.device, dtype=torch.float32)
    count = torch.empty((), device=x.device, dtype=torch.float32)
    grad_w = torch.empty(C, D, device=x.device, dtype=weight.dtype)
    block = pow2_at_least(D)
    _kernel[(C,)](x, weight, pairs, labels, loss, count, grad_w, B, D, x.stride(0), weight.stride(0), float(eps),
                  BLOCK=block, num_warps=4 if block <= 2048 else 8)
    return loss, count, grad_w


class _PooledGSLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, x, pairs, labels, eps):
        loss, count, grad_w = _launch(weight, x.detach(), pairs, labels, eps)
        ctx.save_for_backward(grad_w)
        ctx.mark_non_differentiable(count)
        return loss, count

    @staticmethod
    def backward(ctx, grad_loss, _grad_count):
        (grad_w,) = ctx.saved_tensors
        return grad_w * grad_loss.to(grad_w.dtype), None, None, None, None


def pooled_gs_loss(weight, x, pairs, labels, eps=1e-8):
    """``(L, count)``: the pooled GS loss (module docstring) differentiable w.r.t. `weight` only (x is a detached
    target), and the number of counterfactual pairs (float32, 0-d). `pairs` and `labels` int [B] on x's device
    (`pairs[i] = -1`: no partner); labels in [0, C)."""
    return _PooledGSLoss.apply(weight, x, pairs.contiguous(), labels.contiguous(), eps)


def reference(weight, x, pairs, labels, eps=1e-8):
    """``(L, count, ∂L/∂W)`` by the composite of `cat_fast.kernels.reference.pooled_gs_loss`."""
    return _reference.pooled_gs_loss(weight, x, pairs, labels, eps)
