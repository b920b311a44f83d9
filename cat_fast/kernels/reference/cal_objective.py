"""CAL objective per sample (docs/METHODS.md §1.2 without the norm term): gamma * CE(z_i, y_i) + eta * max softmax(z_i)."""
import torch.nn.functional as F

from ..dtypes import upcast


def cal_objective(logits, labels, gamma, eta):
    z = upcast(logits)
    ce = F.cross_entropy(z, labels, reduction="none")
    phi = z.softmax(-1).amax(-1)
    return gamma * ce + eta * phi
