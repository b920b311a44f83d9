"""The fused ops of cat_fast: plain functions on tensors, for your own objectives.

Each validates its arguments (`validate`), then runs on the backend `backend.select` picks (`reference`, `cpp`,
`cuda`, `triton`; `cat_fast.backends()`, `cat_fast.use_backend()`). `modules` has their `torch.nn.Module` wrappers
(`CMix`, `CALObjective`, `CRMLoss`, `GSCosineLoss`). The bias-model losses (`bias_losses`: `poe_loss`,
`reweighted_loss`, `learned_mixin_loss`, `conf_reg_loss`) share one kernel pair (`bias_loss`).
`sample_characteristics` gives CLP's per-sample inputs. `fused` gives the layers and objectives the kernels that are
not ops (`fused_kernels`): nothing above `ops` imports `cat_fast.kernels` or `cat_fast._C` itself. Adding an op:
CONTRIBUTING.md.
"""
from .backend import backends, use_backend
from .bias_losses import BiasLoss, conf_reg_loss, learned_mixin_loss, poe_loss, reweighted_loss
from .cal_objective import cal_objective
from .cal_step import cal_step_
from .cmix import MASK_MODES, cmix
from .crm_loss import crm_loss, crm_weights
from .fused import FUSED_KERNELS, fused_kernels, upcast
from .gs_cosine_loss import gs_cosine_loss
from .modules import CALObjective, CMix, CRMLoss, GSCosineLoss
from .sample_characteristics import CHARACTERISTICS, CLASS_STATS, sample_characteristics

__all__ = ["cmix", "cal_objective", "cal_step_", "crm_loss", "crm_weights", "gs_cosine_loss", "MASK_MODES",
           "CMix", "CALObjective", "CRMLoss", "GSCosineLoss", "backends", "use_backend", "poe_loss", "reweighted_loss",
           "learned_mixin_loss", "conf_reg_loss", "BiasLoss", "sample_characteristics", "CHARACTERISTICS",
           "CLASS_STATS", "fused_kernels", "FUSED_KERNELS", "upcast"]
