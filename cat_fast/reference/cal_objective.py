"""CAL objective per sample (SPEC §1.2 without the norm term): gamma * CE(z_i, y_i) + eta * max softmax(z_i)."""
import torch
import torch.nn.functional as F


def cal_objective(logits, labels, gamma, eta):
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    ce = F.cross_entropy(z, labels, reduction="none")
    phi = z.softmax(-1).amax(-1)
    return gamma * ce + eta * phi
