"""Pure-PyTorch references of every op: the oracle the kernels are tested against (docs/METHODS.md)."""
from .bias_losses import conf_reg_loss, learned_mixin_loss, poe_loss, reweighted_loss
from .cal_objective import cal_objective
from .cal_step import cal_step_
from .cmix import cmix, mix_mask
from .crm_loss import crm_loss, crm_weights
from .gs_cosine_loss import gs_cosine_loss
from .sample_characteristics import sample_characteristics

__all__ = ["cmix", "mix_mask", "cal_objective", "cal_step_", "crm_loss", "crm_weights", "gs_cosine_loss",
           "poe_loss", "reweighted_loss", "learned_mixin_loss", "conf_reg_loss", "sample_characteristics"]
