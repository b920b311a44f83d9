"""Training objectives: ``loss, info = objective(batch)``, each a subclass of `Objective`, named in one registry.

- `CAT` (`cat`, with its CUDA-graph CAL loop in `cat_graphs`): counterfactual adversarial training, docs/METHODS.md §1;
- `GradientSupervision` (`gs`): gradient supervision, docs/METHODS.md §2;
- `PoE`, `Reweight`, `LearnedMixin`, `ConfidenceRegularization` (`debias`): bias-model losses, docs/METHODS.md §4;
- `CLP` (`clp`): causal logit perturbation, meta-learned per-example perturbations of the true-class logit,
  docs/METHODS.md §5;
- `ERM` (`erm`): the model's own loss.

``build("cat-star", model)`` makes a registered objective; ``names()`` lists them; the CLI and the Trainer
classes use the same registry. Adding a method: subclass `Objective` (`base`) with its declarations (`config`: its
options as a dataclass, the batch columns it ``requires``, the ``curves`` of its info), then one `register` line
here — or, outside cat_fast, ``cat_fast.objectives.register`` or an entry point of the ``cat_fast.objectives``
group. Nothing else changes: the CLI's flags, the Trainer's columns and the plot come from the declarations.
"""
from .base import Entry, Objective, build, get, names, register
from .cat import CAT, default_layers
from .cat_options import CATConfig
from .clp import CLP, CLPConfig
from .config import (
    BIAS,
    CONTEXT_MASK,
    METADATA,
    PAIRS,
    TEACHER,
    Curve,
    ObjectiveConfig,
    Requirement,
    option,
)
from .debias import BiasObjective, ConfidenceRegularization, LearnedMixin, LearnedMixinConfig, PoE, Reweight
from .double_backward import DOUBLE_BACKWARD_HINT, double_backward_error
from .erm import ERM, ERMConfig
from .gs import GradientSupervision, GSConfig
from .gs_pairs import pair_by_group

__all__ = ["Objective", "Entry", "register", "get", "names", "build", "CAT", "default_layers", "ERM",
           "GradientSupervision", "pair_by_group", "double_backward_error", "DOUBLE_BACKWARD_HINT", "BiasObjective",
           "PoE", "Reweight", "LearnedMixin", "ConfidenceRegularization", "CLP", "ObjectiveConfig", "option",
           "Requirement", "Curve", "PAIRS", "BIAS", "TEACHER", "METADATA", "CONTEXT_MASK", "CATConfig", "GSConfig",
           "ERMConfig", "CLPConfig", "LearnedMixinConfig", "batch_columns", "configs"]


def batch_columns() -> tuple:
    """Every batch column that the registered objectives require (never passed to the model's forward)."""
    from ..models.inputs import metadata_keys

    names()  # the plugins' requirements too
    return metadata_keys()


def configs() -> dict:
    """Method name -> its objective's config class, for every registered objective (plugins included)."""
    return {name: get(name).cls.config for name in names()}

register("erm", ERM, "the model's own cross-entropy")
register("erm-orig", ERM, "the model's own cross-entropy, trained on originals only", data="orig")
register("erm-two-step", ERM, "ERM with a second AdamW step per batch at --crm-lr: the equal-update control of "
         "cat --cat-update alternate", warmup=True, two_step=True)
register("cat", CAT, "CAT: CMIX + CAL (3 steps) + CRM", warmup=True, adv_steps=3)
register("cat-star", CAT, "CAT*: CMIX + CRM, no CAL", warmup=True, adv_steps=0)
register("cat-gs", CAT, "CAT + gradient supervision on the CMIX pair", warmup=True, eager_attention=True,
         adv_steps=3, gs_weight=1.0)
register("gs", GradientSupervision, "gradient supervision on counterfactual pairs", eager_attention=True)
register("gs-random", GradientSupervision, "gradient supervision on random pairs (the paper's ablation)",
         eager_attention=True, random_pairs=True)
register("poe", PoE, "product of experts with a bias model (--bias)")
register("reweight", Reweight, "examples reweighted by 1 - p_bias(y) (--bias)")
register("reweight-inverse", Reweight, "examples reweighted by 1 / p_bias(y), the mediation paper's code (--bias)",
         weight="inverse")
register("learned-mixin", LearnedMixin, "learned-mixin +H with a bias model (--bias)")
register("conf-reg", ConfidenceRegularization, "confidence regularisation (--bias, --teacher)")
register("clp", CLP, "causal logit perturbation, head-only virtual step (--meta-data or a balanced CAD dev draw)",
         data="orig")
register("clp-all", CLP, "causal logit perturbation, virtual step of every parameter (double backward)",
         data="orig", eager_attention=True, virtual="all")
