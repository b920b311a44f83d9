"""CRM (docs/METHODS.md §1.3): clip(Phi(z_i) / Phi(z~_i), a1, a2) * CE(z_i, y_i), Phi = max softmax.

Rows whose label is `ignore_index` give 0 (and no gradient) and do not count in the mean (all rows ignored: NaN,
like F.cross_entropy). Phi's gradient goes to the first of tied maxima."""
import torch
import torch.nn.functional as F

from ..dtypes import upcast
from ._common import max_softmax


def crm_weights(logits, cf_logits, a1=0.0, a2=10.0):
    phi = max_softmax(upcast(logits))
    phi_cf = max_softmax(upcast(cf_logits))
    return (phi / phi_cf).clamp(a1, a2)


def crm_loss(logits, cf_logits, labels, a1=0.0, a2=10.0, detach_weight=True, reduction="mean", ignore_index=-100):
    weight = crm_weights(logits, cf_logits, a1, a2)
    if detach_weight:
        weight = weight.detach()
    keep = labels != ignore_index
    ce = F.cross_entropy(upcast(logits), labels, reduction="none", ignore_index=ignore_index)
    losses = torch.where(keep, weight * ce, 0.0)
    if reduction == "mean":
        return losses.sum() / keep.sum()
    if reduction == "sum":
        return losses.sum()
    return losses
