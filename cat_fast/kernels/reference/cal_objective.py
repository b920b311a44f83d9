"""CAL objective per sample (docs/METHODS.md §1.2 without the norm term): gamma * CE(z_i, y_i) + eta * max softmax(z_i).

Rows whose label is `ignore_index` give 0 (and no gradient). Phi's gradient goes to the first of tied maxima."""
import torch
import torch.nn.functional as F

from ..dtypes import upcast
from ._common import max_softmax


def cal_objective(logits, labels, gamma, eta, ignore_index=-100):
    z = upcast(logits)
    keep = labels != ignore_index
    ce = F.cross_entropy(z, labels, reduction="none", ignore_index=ignore_index)
    return torch.where(keep, gamma * ce + eta * max_softmax(z), 0.0)
