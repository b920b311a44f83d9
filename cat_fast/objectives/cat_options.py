"""CAT's options: the default mixing layers, the constructor's argument checks, and the keyword arguments built
from the CLI's options (`CAT.from_options`). The method's parameters are described on `cat.CAT`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..ops import MASK_MODES
from .base import check_number, check_single_label
from .config import Curve, ObjectiveConfig, count, float_pair, int_list, option

__all__ = ["default_layers", "check_arguments", "options_kwargs", "CATConfig", "CAT_CURVES"]


@dataclass
class CATConfig(ObjectiveConfig):
    """CAT's options (docs/METHODS.md §1), named as the command line's (`options_kwargs` maps them)."""

    title = "CAT"
    cat_layers: Optional[List[int]] = option(None, type=int_list, metavar="M,M,...", help="CAT mixing layers Q "
                                             "(default: the paper's {8,9,10} of 12 scaled to the model's depth)")
    alpha: float = option(0.3, low=0.0, low_open=True, help="CAT: λ ~ Beta(alpha, beta)")
    beta: float = option(0.3, low=0.0, low_open=True, help="CAT: λ ~ Beta(alpha, beta)")
    gamma: float = option(10.0, help="CAT: weight of the CE term of the CAL objective")
    eta: float = option(20.0, help="CAT: weight of the max-probability term of the CAL objective")
    adv_steps: Optional[int] = option(None, type=count, help="CAL steps (default: the method's: 3 for cat and cat-gs, "
                                      "0 for cat-star)")
    adv_lr: float = option(2e-2, low=0.0, help="CAL step size on λ")
    mask_mode: str = option("self", choices=("self", "partner", "union", "intersection"),
                            help="CAT: attention mask of the mixed sequence")
    cat_update: str = option("sum", choices=("sum", "alternate"), help="CAT update: one summed ERM + CRM loss, or the "
                             "paper's alternating CRM then ERM steps")
    crm_lr: float = option(2e-5, low=0.0, help="learning rate of the CRM step with --cat-update alternate (and of "
                           "erm-two-step's extra step)")
    gs_weight: float = option(1.0, low=0.0, help="weight of the GS loss (gs, gs-random, cat-gs)")
    crm_clip: Optional[Tuple[float, float]] = option(None, type=float_pair, metavar="A1,A2", help="CAT: clip range "
                                                     "[A1, A2] of the CRM weight ω (default 0,10, the paper's main "
                                                     "text; its appendix searches within [0.9, 2])")


CAT_CURVES = (Curve("erm_loss", "ERM part"), Curve("crm_loss", "CRM part", after_warmup=True),
              Curve("gs_loss", "GS part", after_warmup=True),
              Curve("lambda_before", "lambda before", "λ / CRM weight", after_warmup=True),
              Curve("lambda_after", "lambda after", "λ / CRM weight", after_warmup=True),
              Curve("crm_weight_mean", "crm weight mean", "λ / CRM weight", after_warmup=True))


def default_layers(num_layers: int) -> list:
    """The paper's {8, 9, 10}-of-12 mixing layers scaled to `num_layers` (`cat.CAT`'s ``layers``)."""
    return sorted({min(num_layers, max(1, math.floor(k * num_layers / 12 + 0.5))) for k in (8, 9, 10)})


def check_arguments(model, st, layers, alpha, beta, gamma, eta, adv_steps, adv_lr, p, a1, a2, gs_weight,
                    warmup_steps, mask_mode, update, partner, max_graphs) -> dict:
    """`CAT`'s arguments for `model` (its `models.structure` `st`) checked — a ValueError or TypeError naming the
    first bad one — and the checked values that `check_number` normalises, with the mixing layers as a sorted
    list (None: `default_layers`)."""
    L = st.num_layers
    if layers is None:
        layers = default_layers(L)
    elif isinstance(layers, int):
        layers = [layers]
    layers = sorted({int(m) for m in layers})
    if not layers or layers[0] < 0 or layers[-1] > L:
        raise ValueError(f"layers: expected mixing layers within [0, {L}] for {st.model_class} (it has {L} "
                         f"layers), got {layers}")
    alpha = check_number("alpha", alpha, low=0, low_open=True)
    beta = check_number("beta", beta, low=0, low_open=True)
    gamma, eta = check_number("gamma", gamma), check_number("eta", eta)
    adv_steps = check_number("adv_steps", adv_steps, low=0, integer=True)
    adv_lr = check_number("adv_lr", adv_lr, low=0)
    p = check_number("p", p, low=1)
    for name, value in (("a1", a1), ("a2", a2)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ValueError(f"{name}: expected a number (inf allowed, not NaN), got {value!r}")
    gs_weight = check_number("gs_weight", gs_weight, low=0)
    warmup_steps = check_number("warmup_steps", warmup_steps, low=0, integer=True)
    if mask_mode not in MASK_MODES:
        raise ValueError(f"mask_mode must be one of {MASK_MODES}, got {mask_mode!r}")
    if update not in ("sum", "alternate"):
        raise ValueError(f"update must be 'sum' or 'alternate', got {update!r}")
    if partner not in ("permutation", "replacement"):
        raise ValueError(f"partner must be 'permutation' or 'replacement', got {partner!r}")
    if a1 > a2:
        raise ValueError(f"a1 must be <= a2, got {a1} > {a2}")
    if int(max_graphs) != max_graphs or max_graphs < 0:
        raise ValueError(f"max_graphs must be an integer >= 0, got {max_graphs!r}")
    if gs_weight > 0 and st.task != "sequence_classification":
        raise ValueError("gs_weight > 0 (CAT + GS) is supported for *ForSequenceClassification models only")
    if st.task == "sequence_classification":
        check_single_label(model.config, "CAT")
    return dict(layers=layers, alpha=alpha, beta=beta, gamma=gamma, eta=eta, adv_steps=adv_steps, adv_lr=adv_lr,
                p=p, gs_weight=gs_weight, warmup_steps=warmup_steps)


def options_kwargs(model, options, preset) -> dict:
    """`CAT`'s keyword arguments from the CLI's `options` over the registry's `preset` (`CAT.from_options`)."""
    kw = dict(preset)
    for key, name in (("cat_layers", "layers"), ("alpha", "alpha"), ("beta", "beta"), ("gamma", "gamma"),
                      ("eta", "eta"), ("adv_steps", "adv_steps"), ("adv_lr", "adv_lr"),
                      ("mask_mode", "mask_mode"), ("cat_update", "update")):
        if options.get(key) is not None:
            kw[name] = options[key]
    if options.get("crm_clip") is not None:
        kw["a1"], kw["a2"] = options["crm_clip"]
    if kw.get("gs_weight", 0) > 0 and options.get("gs_weight") is not None:
        kw["gs_weight"] = options["gs_weight"]
    if options.get("seed") is not None and "generator" not in kw:
        kw["generator"] = torch.Generator().manual_seed(options["seed"])
    if kw.get("update") == "alternate" and kw.get("crm_optimizer") is None:
        # the paper's alternating step: a separate optimizer (lr 2e-5 in the paper) steps on CRM first
        kw["crm_optimizer"] = torch.optim.AdamW(model.parameters(), lr=options.get("crm_lr", 2e-5))
    return kw
