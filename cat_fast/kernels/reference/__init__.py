"""Pure-PyTorch references of every op: the oracle the kernels are tested against (docs/METHODS.md)."""
from .bias_losses import confidence_regularization_loss, learned_mixin_loss, poe_loss, reweight_loss
from .cal_objective import cal_objective
from .cal_step import cal_step_
from .cmix import cmix, mix_mask
from .crm_loss import crm_loss, crm_weights
from .gs_cosine_loss import gs_cosine_loss
from .sample_characteristics import sample_characteristics

__all__ = ["cmix", "mix_mask", "cal_objective", "cal_step_", "crm_loss", "crm_weights", "gs_cosine_loss",
           "poe_loss", "reweight_loss", "learned_mixin_loss", "confidence_regularization_loss", "sample_characteristics"]
