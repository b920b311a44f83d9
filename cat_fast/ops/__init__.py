"""The fused ops of cat_fast. Each validates its arguments, then runs on the selected backend (`cat_fast.backends()`)."""
from .cal_objective import cal_objective
from .cal_step import cal_step_
from .cmix import cmix
from .crm_loss import crm_loss, crm_weights
from .gs_cosine_loss import gs_cosine_loss

__all__ = ["cmix", "cal_objective", "cal_step_", "crm_loss", "crm_weights", "gs_cosine_loss"]
