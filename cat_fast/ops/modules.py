"""`torch.nn.Module` wrappers of the fused ops, as `torch.nn.CrossEntropyLoss` wraps `F.cross_entropy`.

Each checks its constructor arguments once (errors name the argument) and calls the functional op in `forward`::

    cal = CALObjective(reduction="mean")          # gamma=10, eta=20: the CAT paper's defaults
    objective = cal(cf_logits, labels)
    loss = CRMLoss()(logits, cf_logits, labels)   # a1=0, a2=10, detached weight, mean over non-ignored rows
"""
import torch

from . import validate
from .cal_objective import REDUCTIONS as CAL_REDUCTIONS
from .cal_objective import SCALARS as CAL_SCALARS
from .cal_objective import cal_objective
from .cmix import MASK_MODES, cmix
from .crm_loss import REDUCTIONS as CRM_REDUCTIONS
from .crm_loss import SCALARS as CRM_SCALARS
from .crm_loss import crm_loss
from .gs_cosine_loss import REDUCTIONS as GS_REDUCTIONS
from .gs_cosine_loss import SCALARS as GS_SCALARS
from .gs_cosine_loss import gs_cosine_loss

__all__ = ["CMix", "CALObjective", "CRMLoss", "GSCosineLoss"]


def _bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


class CMix(torch.nn.Module):
    """CMIX hidden-state interpolation: `forward(h, lam, partner, mask=None) -> (h_mix, mask_mix)` (see `cmix`)."""

    def __init__(self, mask_mode="self"):
        super().__init__()
        validate.choice("mask_mode", mask_mode, MASK_MODES)
        self.mask_mode = mask_mode

    def forward(self, h, lam, partner, mask=None):
        return cmix(h, lam, partner, mask, self.mask_mode)

    def extra_repr(self):
        return f"mask_mode={self.mask_mode!r}"


class CALObjective(torch.nn.Module):
    """The CAL objective `gamma * CE + eta * max softmax`: `forward(logits, labels)` (see `cal_objective`)."""

    def __init__(self, gamma=10.0, eta=20.0, reduction="none", ignore_index=-100):
        super().__init__()
        self.gamma, self.eta, self.ignore_index = validate.scalars(CAL_SCALARS, gamma=gamma, eta=eta,
                                                                   ignore_index=ignore_index)
        validate.choice("reduction", reduction, tuple(CAL_REDUCTIONS))
        self.reduction = reduction

    def forward(self, logits, labels):
        return cal_objective(logits, labels, self.gamma, self.eta, self.reduction, self.ignore_index)

    def extra_repr(self):
        return f"gamma={self.gamma}, eta={self.eta}, reduction={self.reduction!r}, ignore_index={self.ignore_index}"


class CRMLoss(torch.nn.Module):
    """The clipped importance-weighted CE: `forward(logits, cf_logits, labels)` (see `crm_loss`)."""

    def __init__(self, a1=0.0, a2=10.0, detach_weight=True, reduction="mean", ignore_index=-100):
        super().__init__()
        self.a1, self.a2, self.ignore_index = validate.scalars(CRM_SCALARS, a1=a1, a2=a2, ignore_index=ignore_index)
        if self.a1 > self.a2:
            raise ValueError(f"a1, a2: expected a1 <= a2 (clip range of the weight), got a1={a1} > a2={a2}")
        self.detach_weight = _bool("detach_weight", detach_weight)
        validate.choice("reduction", reduction, tuple(CRM_REDUCTIONS))
        self.reduction = reduction

    def forward(self, logits, cf_logits, labels):
        return crm_loss(logits, cf_logits, labels, self.a1, self.a2, self.detach_weight, self.reduction,
                        self.ignore_index)

    def extra_repr(self):
        return (f"a1={self.a1}, a2={self.a2}, detach_weight={self.detach_weight}, reduction={self.reduction!r}, "
                f"ignore_index={self.ignore_index}")


class GSCosineLoss(torch.nn.Module):
    """The gradient-supervision loss `1 - cos(g_i, g_hat_i)`: `forward(g, g_hat)` (see `gs_cosine_loss`)."""

    def __init__(self, reduction="mean", eps=1e-8):
        super().__init__()
        validate.choice("reduction", reduction, tuple(GS_REDUCTIONS))
        self.reduction = reduction
        (self.eps,) = validate.scalars(GS_SCALARS, eps=eps)

    def forward(self, g, g_hat):
        return gs_cosine_loss(g, g_hat, self.reduction, self.eps)

    def extra_repr(self):
        return f"reduction={self.reduction!r}, eps={self.eps}"
