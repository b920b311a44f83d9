"""CRM (docs/METHODS.md §1.3): clip(Phi(z_i) / Phi(z~_i), a1, a2) * CE(z_i, y_i), Phi = max softmax."""
import torch.nn.functional as F

from ..dtypes import upcast


def crm_weights(logits, cf_logits, a1=0.0, a2=10.0):
    phi = upcast(logits).softmax(-1).amax(-1)
    phi_cf = upcast(cf_logits).softmax(-1).amax(-1)
    return (phi / phi_cf).clamp(a1, a2)


def crm_loss(logits, cf_logits, labels, a1=0.0, a2=10.0, detach_weight=True, reduction="mean"):
    weight = crm_weights(logits, cf_logits, a1, a2)
    if detach_weight:
        weight = weight.detach()
    losses = weight * F.cross_entropy(upcast(logits), labels, reduction="none")
    if reduction == "mean":
        return losses.mean()
    if reduction == "sum":
        return losses.sum()
    return losses
