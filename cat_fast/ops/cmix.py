"""cmix: CMIX hidden-state interpolation (docs/METHODS.md §1.1), differentiable w.r.t. h and lam to any order."""
import torch

from ..kernels import reference
from . import registry, validate
from .backend import select

registry.define({
    "cmix_forward": "(Tensor h, Tensor lam, Tensor partner) -> Tensor",
    "cmix_backward": "(Tensor grad, Tensor h, Tensor lam, Tensor partner) -> (Tensor, Tensor)",
}, triton="cmix")

MASK_MODES = ("self", "partner", "union", "intersection")


def _grad_lam_rows(grad, h, partner):
    """sum_d (h[partner[i], t, d] - h[i, t, d]) * grad[i, t, d], in the accumulation dtype: [B, T]."""
    acc = registry.acc_dtype(h.dtype)
    return ((h.index_select(0, partner) - h).to(acc) * grad.to(acc)).sum(-1)


def _reduce_like(grad_lam_bt, lam):
    return grad_lam_bt.sum(1) if lam.dim() == 1 else grad_lam_bt


def _forward_backward(family):
    def backward(ctx, grad):
        h, lam, partner = ctx.saved_tensors
        grad_h, grad_lam = family.cmix_backward(grad.contiguous(), h, lam, partner)
        return grad_h, _reduce_like(grad_lam, lam), None

    return backward


def _backward_backward(family):
    # Derivatives of (grad_h, grad_lam) = cmix_backward(grad, h, lam, partner), written with
    # differentiable pieces so that every further order exists too.
    def backward(ctx, gg_h, gg_lam):
        grad, h, lam, partner = ctx.saved_tensors
        d_grad = torch.zeros_like(grad)
        d_h = torch.zeros_like(h)
        d_lam = torch.zeros_like(lam)
        if gg_h is not None:
            d_grad = d_grad + family.cmix_forward(gg_h.contiguous(), lam, partner)
            d_lam = d_lam + _reduce_like(_grad_lam_rows(grad, gg_h, partner), lam).to(lam.dtype)
        if gg_lam is not None:
            weighted = gg_lam.unsqueeze(-1).to(grad.dtype) * grad
            d_grad = d_grad + gg_lam.unsqueeze(-1).to(h.dtype) * (h.index_select(0, partner) - h)
            d_h = d_h - weighted + torch.zeros_like(weighted).index_add(0, partner, weighted)
        return d_grad, d_h, d_lam, None

    return backward


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


registry.register("cmix_forward", lambda h, lam, partner: torch.empty_like(h), _forward_backward, _save_inputs)
registry.register(
    "cmix_backward",
    lambda grad, h, lam, partner: (torch.empty_like(h), h.new_empty(h.shape[:2], dtype=lam.dtype)),
    _backward_backward,
    _save_inputs,
)


def _validate_args(h, lam, partner, mask, mask_mode):
    validate.tensor("h", h, ndims=(3,))
    validate.nonempty_batch("h", h)
    batch, tokens, _ = h.shape
    validate.tensor("lam", lam, ndims=(1, 2))
    validate.size("lam", lam, 0, batch, "batch size B of h")
    if lam.dim() == 2:
        validate.size("lam", lam, 1, tokens, "sequence length T of h, per-token lambda")
    validate.tensor("partner", partner, ndims=(1,), dtypes=(torch.int64, torch.int32))
    validate.shape("partner", partner, (batch,), "one partner index per sample")
    if mask is not None:
        validate.tensor("mask", mask, ndims=(2,), dtypes=None)
        if mask.is_floating_point() or mask.is_complex():
            raise TypeError(f"mask: expected a bool or integer tensor (1 = real token), got {mask.dtype}")
        validate.shape("mask", mask, (batch, tokens), "[B, T] like h")
    validate.choice("mask_mode", mask_mode, MASK_MODES)
    validate.same_device(h=h, lam=lam, partner=partner, mask=mask)
    validate.index_range("partner", partner, batch, "indices into the batch")


def cmix(h, lam, partner, mask=None, mask_mode="self"):
    """Mix each sample's hidden states with its partner's: `h_mix[i] = lam_i * h[partner[i]] + (1 - lam_i) * h[i]`.

    h: [B, T, D] float. lam: [B] (per sample) or [B, T] (per token). partner: int64 [B], any indices
    into the batch (repeats allowed). mask: [B, T] bool/int (1 = real token) or None; mask_mode picks
    the mixed sequence's mask: `self`, `partner`, `union` or `intersection`.
    Returns (h_mix, mask_mix); mask_mix has the dtype of mask (None when mask is None).
    """
    _validate_args(h, lam, partner, mask, mask_mode)
    partner = partner.long()
    backend = select("cmix", h.device)
    if backend == "reference":
        return reference.cmix(h, lam, partner, mask, mask_mode)
    lam_acc = lam.to(registry.acc_dtype(h.dtype)).contiguous()
    h_mix = registry.kernels(backend).cmix_forward(h.contiguous(), lam_acc, partner.contiguous())
    return h_mix, reference.mix_mask(mask, partner, mask_mode)
