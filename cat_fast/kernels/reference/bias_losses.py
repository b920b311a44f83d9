"""Bias-model losses (docs/METHODS.md §4; Clark et al. 2019, Utama et al. 2020) in plain PyTorch: the oracle of the
fused ops. `bias` is a fixed bias model's log-probabilities [B, C] (no gradient), `logits` the main model's [B, C];
rows whose label equals `ignore_index` count for nothing (the means run over the other rows). Everything is computed
in the accumulation dtype of `logits` (float32, float64 for float64 logits): `bias`, `gate` and `teacher_probs` are
cast to it, as the fused kernels read them."""
import torch
import torch.nn.functional as F

from ..dtypes import upcast


def _keep(labels, ignore_index):
    keep = labels != ignore_index
    return keep, torch.where(keep, labels, torch.zeros_like(labels))


def _reduce(losses, keep, reduction, denominator=None):
    losses = torch.where(keep, losses, torch.zeros_like(losses))
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (keep.sum().to(losses.dtype) if denominator is None else denominator)


def _as(x, like):
    return x.to(like.dtype)


def _bias_prob_of_label(bias, labels):
    return bias.exp().gather(1, labels.unsqueeze(1)).squeeze(1)


def poe_loss(logits, bias, labels, reduction="mean", ignore_index=-100):
    """Product of experts: CE(log_softmax(z) + b, y); the model predicts with z alone."""
    keep, y = _keep(labels, ignore_index)
    z = upcast(logits)
    mixed = F.log_softmax(z, -1) + _as(bias, z).detach()
    return _reduce(F.cross_entropy(mixed, y, reduction="none"), keep, reduction)


def reweighted_loss(logits, bias, labels, normalize="weights", weight="one_minus", ignore_index=-100):
    """Example reweighting: w = 1 − p_b(y) (Clark) or 1 / p_b(y) (the mediation paper's released code);
    Σ w·CE / Σ w (``normalize="weights"``) or / the number of rows (``"batch"``)."""
    keep, y = _keep(labels, ignore_index)
    z = upcast(logits)
    p = _bias_prob_of_label(_as(bias, z).detach(), y)
    w = 1 - p if weight == "one_minus" else 1 / p
    w = torch.where(keep, w, torch.zeros_like(w))
    ce = F.cross_entropy(z, y, reduction="none")
    if normalize == "weights":
        return (w * ce).sum() / w.sum()
    return (w * ce).sum() / keep.sum().to(ce.dtype)


def learned_mixin_loss(logits, bias, labels, gate, entropy_weight=0.03, ignore_index=-100, reduction="mean"):
    """Learned-mixin +H: g = softplus(gate) per row (`gate` [B], a learned linear map of the pooled vector);
    CE(log_softmax(z) + g·b, y) + entropy_weight · H(softmax(g·b)), both means over the kept rows."""
    keep, y = _keep(labels, ignore_index)
    z = upcast(logits)
    g = F.softplus(_as(gate, z)).unsqueeze(1)
    scaled = g * _as(bias, z).detach()
    ce = F.cross_entropy(F.log_softmax(z, -1) + scaled, y, reduction="none")
    lp = F.log_softmax(scaled, -1)
    entropy = -(lp.exp() * lp).sum(-1)
    return _reduce(ce + entropy_weight * entropy, keep, reduction)


def conf_reg_loss(logits, bias, labels, teacher_probs, ignore_index=-100, reduction="mean"):
    """Confidence regularisation: the teacher's probabilities scaled t̃ ∝ t^(1 − p_b(y)), loss −Σ t̃ log softmax(z),
    mean over the kept rows."""
    keep, y = _keep(labels, ignore_index)
    z = upcast(logits)
    exponent = (1 - _bias_prob_of_label(_as(bias, z).detach(), y)).unsqueeze(1)
    scaled = _as(teacher_probs, z).detach() ** exponent
    scaled = scaled / scaled.sum(-1, keepdim=True)
    losses = -(scaled * F.log_softmax(z, -1)).sum(-1)
    return _reduce(losses, keep, reduction)
