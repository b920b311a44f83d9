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
SCALARS = {"lam": {}}  # a number lam: finite (a tensor lam's values are not read: that would sync)


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


LAM_FORMS = ("lam may be a number, a 0-d tensor, or a tensor of shape [B], [B, 1], [B, T], [1, T], [B, T, 1] "
             "(any size-B dim may be 1): per-sample or per-token lambda; per-feature [B, D] lambda is not supported")


def _lam_rows(lam, h):
    """Check `lam` and return it as the tensor the kernels take: [B] (per sample) or [B, T] (per token).

    A number becomes a [B] tensor in the accumulation dtype of h; a tensor is reshaped and expanded (a view, so
    that autograd returns its gradient in lam's own shape)."""
    batch, tokens, _ = h.shape
    if not isinstance(lam, torch.Tensor):
        if isinstance(lam, bool) or not isinstance(lam, (int, float)):
            raise TypeError(f"lam: expected a torch.Tensor or a number, got {type(lam).__name__}")
        (lam,) = validate.scalars(SCALARS, lam=lam)
        return torch.full((batch,), lam, dtype=registry.acc_dtype(h.dtype), device=h.device)
    validate.tensor("lam", lam)
    shape = tuple(lam.shape)
    if shape == (batch,) or shape == (batch, tokens):
        return lam
    if lam.dim() > 3:
        raise ValueError(f"lam: expected at most 3 dimensions ({LAM_FORMS}), got shape {shape}")
    if lam.dim() >= 1 and shape[0] not in (batch, 1):
        raise ValueError(f"lam: expected size {batch} (or 1) in dim 0 (batch size B of h; {LAM_FORMS}), got shape {shape}")
    if lam.dim() >= 2 and shape[1] not in (tokens, 1):
        raise ValueError(f"lam: expected size {tokens} (or 1) in dim 1 (sequence length T of h, per-token lambda; "
                         f"{LAM_FORMS}), got shape {shape}")
    if lam.dim() == 3 and shape[2] != 1:
        raise ValueError(f"lam: expected size 1 in dim 2 ({LAM_FORMS}), got shape {shape}")
    if lam.dim() >= 2 and shape[1] != 1:  # per token
        return lam.reshape(shape[0], tokens).expand(batch, tokens)
    return lam.reshape(shape[:1]).expand(batch)  # per sample (a 0-d lam gives shape (), expanded alike)


def _validate_args(h, lam, partner, mask, mask_mode):
    validate.tensor("h", h, ndims=(3,))
    validate.nonempty_batch("h", h)
    batch, tokens, _ = h.shape
    lam = _lam_rows(lam, h)
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
    return lam


def cmix(h, lam, partner, mask=None, mask_mode="self"):
    """Mix each sample's hidden states with its partner's: `h_mix[i] = lam_i * h[partner[i]] + (1 - lam_i) * h[i]`.

    h: [B, T, D] float. lam: per sample or per token — a finite number, a 0-d tensor, or a float tensor that broadcasts
    to [B] or [B, T]: [B], [B, 1], [B, T], [1, T], [B, T, 1] (a size-B dim may be 1); gradients w.r.t. a tensor lam
    come back in its own shape. Per-feature [B, D] lambda is not supported. partner: int64 [B], any indices
    into the batch (repeats allowed). mask: [B, T] bool/int (1 = real token) or None; mask_mode picks
    the mixed sequence's mask: `self`, `partner`, `union` or `intersection`.
    Returns (h_mix, mask_mix); mask_mix has the dtype of mask (None when mask is None).
    """
    lam = _validate_args(h, lam, partner, mask, mask_mode)
    partner = partner.long()
    backend = select("cmix", h.device)
    if backend == "reference":
        return reference.cmix(h, lam, partner, mask, mask_mode)
    lam_acc = lam.to(registry.acc_dtype(h.dtype)).contiguous()
    h_mix = registry.kernels(backend).cmix_forward(h.contiguous(), lam_acc, partner.contiguous())
    return h_mix, reference.mix_mask(mask, partner, mask_mode)


def mix_mask(mask, partner, mask_mode="self"):
    """The attention mask of the mixed sequences (`cmix`'s second output) without the mixing: mask [B, T] bool/int,
    partner int [B] (indices into the batch), mask_mode as in `cmix`."""
    validate.tensor("mask", mask, ndims=(2,), dtypes=None)
    validate.tensor("partner", partner, ndims=(1,), dtypes=(torch.int64, torch.int32))
    validate.shape("partner", partner, (mask.shape[0],), "one partner index per sample")
    validate.choice("mask_mode", mask_mode, MASK_MODES)
    return reference.mix_mask(mask, partner.long(), mask_mode)
