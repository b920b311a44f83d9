"""CAT — counterfactual adversarial training (Wang et al. 2021), the paper's Algorithm 1 (docs/METHODS.md §1).

``loss, info = CAT(model)(batch)`` for a Hugging Face ``*ForSequenceClassification`` or ``*ForQuestionAnswering``
model; `batch` is what the model takes plus ``labels`` (``start_positions`` / ``end_positions`` for QA). One call is
one training step: warm-up ERM, or CMIX at a drawn layer, CAL on λ and ERM + CRM (see `CAT` for the arguments).
On a GPU the CAL loop is replayed as CUDA graphs (`cat_graphs`). Beside this module: the argument checks and the
CLI's options (`cat_options`), the classification vs question-answering handling (`cat_tasks`) and the random draws
(`cat_draws`).
"""
from __future__ import annotations

import contextlib

import torch

from .. import models
from ..layers import casts, packing
from ..layers import training as training_layers
from ..ops import cal_step_, cmix, gs_cosine_loss
from ..ops.cmix import mix_mask
from ..step import NotCapturable, StepPlan
from .base import Objective
from .cat_draws import Draws
from .cat_graphs import CALGraphs
from .cat_options import CAT_CURVES, CATConfig, check_arguments, default_layers, options_kwargs
from .cat_tasks import task_for
from .config import CONTEXT_MASK
from .double_backward import check_double_backward
from .gs_pairs import masked_mean

__all__ = ["CAT", "default_layers"]


class CAT(Draws, Objective):
    """Counterfactual adversarial training; ``loss, info = cat(batch)``.

    Method (docs/METHODS.md §1): ``layers`` — the mixing-layer set Q, 1-indexed (``hidden_states[m]``), one drawn
    per step; None scales the paper's {8, 9, 10}-of-12 to the depth (`default_layers`). ``alpha``, ``beta`` — λ ~
    Beta(α, β) per sample. ``partner`` — ``"permutation"`` of the batch or ``"replacement"``. ``mask_mode`` — the
    mixed sequence's attention mask: ``self``, ``partner``, ``union`` or ``intersection`` (§1.1). ``gamma``, ``eta``,
    ``adv_steps``, ``adv_lr``, ``p`` — CAL (§1.2; ``adv_steps=0`` is CAT*). ``a1``, ``a2``, ``detach_weight`` — CRM
    (§1.3). ``update`` — ``"sum"`` (ERM + CRM, one backward) or ``"alternate"`` (the paper's: a CRM step on
    ``crm_optimizer``, then ERM on the updated model, returned for the caller's step) (§1.4). ``warmup_steps`` —
    calls of plain ERM first (``step`` counts calls; the trainers set it to the optimizer step). ``gs_weight`` —
    adds gradient supervision on the CMIX pair (h_m, h̃_m), which needs an attention kernel with double backward.
    QA: the non-answer context only is mixed (§1.5).

    Speed (same values; each has an off switch): ``cuda_graph`` — the CAL steps and the final counterfactual pass
    as CUDA graphs per batch signature, up to ``max_graphs``; ``prune_last_layer`` — the last layer for row 0 only
    where the head reads nothing else (§1.6); ``fast_resume`` — the counterfactual passes run `layers.resumed`;
    ``training_layers`` — the clean forward runs `layers.training` (off with ``gs_weight > 0``).

    Randomness: ``generator=None`` draws the mixing layer and the partners from the global CPU RNG and λ from the
    global RNG of the model's device; a CPU ``torch.Generator`` makes every draw reproducible on any device.
    ``info`` holds detached 0-d tensors (``erm_loss``, ``crm_loss``, ``lambda_before``, ``lambda_after``,
    ``crm_weight_mean``, ``cal_objective``, ``layer``, ``cat_active``, and ``gs_loss`` with GS): no host
    synchronisation inside the step.
    """

    config = CATConfig  # its options (`cat_options`)
    requires = (CONTEXT_MASK,)  # QA: the context tokens, when the batch has them
    curves = CAT_CURVES

    def __init__(self, model, layers=None, alpha=0.3, beta=0.3, gamma=10.0, eta=20.0, adv_steps=3, adv_lr=2e-2,
                 p=1.0, a1=0.0, a2=10.0, mask_mode="self", detach_weight=True, update="sum", warmup_steps=0,
                 partner="permutation", gs_weight=0.0, generator=None, crm_optimizer=None, cuda_graph=True,
                 max_graphs=8, prune_last_layer=True, fast_resume=True, training_layers=True):
        given, model = model, models.unwrap(model)  # `Objective` finds a torch.compile wrapper in `given`
        st = models.structure(model)
        c = check_arguments(model, st, layers, alpha, beta, gamma, eta, adv_steps, adv_lr, p, a1, a2, gs_weight,
                            warmup_steps, mask_mode, update, partner, max_graphs)
        layers, alpha, beta, gamma, eta = c["layers"], c["alpha"], c["beta"], c["gamma"], c["eta"]
        adv_steps, adv_lr, p, gs_weight = c["adv_steps"], c["adv_lr"], c["p"], c["gs_weight"]
        warmup_steps = c["warmup_steps"]
        super().__init__(given)
        self.structure = st
        self.task = task_for(st)  # what classification and question answering differ in (`cat_tasks`)
        self.layers = layers
        self.alpha, self.beta = float(alpha), float(beta)
        self.gamma, self.eta = float(gamma), float(eta)
        self.adv_steps, self.adv_lr, self.p = int(adv_steps), float(adv_lr), float(p)
        self.a1, self.a2 = float(a1), float(a2)
        self.mask_mode = mask_mode
        self.detach_weight = detach_weight
        self.update = update
        self.warmup_steps = int(warmup_steps)
        self.partner = partner
        self.gs_weight = float(gs_weight)
        self.generator = generator
        # the mixing layer's own stream, when set: under DDP (`cat_fast.distributed.DistributedObjective`) one seed on
        # every rank, so that all ranks resume from the same layer each step (equal work: no rank waits for another
        # at the all-reduce), while partners and λ stay each rank's own
        self.layer_generator = None
        self.crm_optimizer = crm_optimizer
        self.step = 0
        self.qa = self.task.qa
        self.cuda_graph = bool(cuda_graph)
        self.prune_last_layer = bool(prune_last_layer)
        self.fast_resume = bool(fast_resume)
        self.training_layers = bool(training_layers)
        self.graphs = CALGraphs(self, max_graphs=max_graphs)
        self._concentration = None  # (B, device, dtype), the [B, 2] Beta concentrations of `_draw_lambda`
        self._pass_rng = {}  # (mixing layer, input shapes) -> models.PassGenerators of planned steps (`plan_step`)

    @classmethod
    def from_options(cls, model, options, **preset):
        """CAT from the CLI's options: ``cat_layers``, ``alpha``, ``beta``, ``gamma``, ``eta``, ``adv_steps`` (None
        keeps the preset's), ``adv_lr``, ``mask_mode``, ``cat_update``, ``crm_lr`` (the alternating update's own
        AdamW), ``crm_clip`` ((A1, A2)), ``gs_weight`` (where the preset turns GS on) and ``seed`` (a CPU generator: reproducible draws)."""
        return cls(model, **options_kwargs(model, options, preset))

    def set_optimizer(self, optimizer):
        """The alternating update steps `optimizer` on CRM when no ``crm_optimizer`` was given."""
        if self.update == "alternate" and self.crm_optimizer is None:
            self.crm_optimizer = optimizer

    @property
    def packs_rows(self) -> bool:
        """With the training layers, without GS and for a head that reads the first token (`Objective.packs_rows`):
        CMIX mixes h_m row by row with the partner's, so a partner shorter than its sample lends the padding rows of
        its h_m; the step packs those rows too (`packed_rows`), computed as the padded path computes them, up to h_m:
        layers m+1..L of the clean forward and of every counterfactual pass pack the mixed sequences' rows only
        (`narrowed_rows`; self: the real ones, whose keys need no gather). Not QA:
        its loss reads the logits of every position, padding included, which the packed path does not compute."""
        return self.training_layers and self.gs_weight == 0 and self.task.first_token_head

    @property
    def packed_min_rows(self) -> int | None:
        """The fewest rows from which a captured step packs by default (`Objective.packed_min_rows`): the default
        4,096 where the lent rows are carried apart (`lent_rows_apart`), 8,192 where they are packed with the real
        ones. With the mixing layer fixed, at 32x128 (4,096 rows) the packed step took 4-8 % less than the padded
        one at each of the layers 8, 9 and 10 with the lent rows apart, 1-3 % more with them packed; from 8,192 rows
        it took 5-10 % less either way (benchmarks/RESULTS.md, "Packed CAT by mixing layer" and "Packed CAT: the
        lent rows carried apart"). PACKED = True packs it at any size."""
        return None if self.lent_rows_apart else 8192

    def packed_rows(self, batch, tensors):
        """The [B, T] rows a packed step computes (`layers.packing.extended`), for the planned partners
        (``tensors["partner"]``): each sample's real tokens, the positions its mixed sequence keeps (`mask_mode`)
        and those of every mixed sequence it is the partner of. None without a 2-D attention mask."""
        found = self._real_and_mixed(batch, tensors)
        if found is None:
            return None
        real, partner, mixed = found
        lent = torch.zeros(real.shape, device=real.device, dtype=torch.int32)
        lent.index_add_(0, partner, mixed.to(torch.int32))
        return real | mixed | (lent > 0)

    @property
    def lent_rows_apart(self) -> bool:
        """With the CRM weight detached the padding rows partners lend to CMIX take no gradient: a packed step's
        layers up to h_m pack the real tokens only and carry the lent rows apart, forward only
        (`layers.packing.lent`, `Objective.lent_rows_apart`); `layers.packing.LENT = False` or ``NARROW = False``
        packs them with the real ones, for comparisons."""
        return self.detach_weight and packing.LENT and packing.NARROW

    def narrowed_rows(self, batch, tensors):
        """The [B, T] rows the layers past the mixing layer pack (`layers.packing.narrow`): the real tokens and
        the positions each mixed sequence keeps (`mask_mode`): the padding rows a partner lends to CMIX are needed
        up to h_m only. None where `packed_rows` is."""
        found = self._real_and_mixed(batch, tensors)
        return None if found is None else found[0] | found[2]

    def _real_and_mixed(self, batch, tensors):
        """``(real tokens, partners, positions each mixed sequence keeps)`` ([B, T] boolean, [B] on the mask's
        device, [B, T] boolean) for the batch's 2-D attention mask and ``tensors["partner"]``, else None."""
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        partner = tensors.get("partner") if isinstance(tensors, dict) else None
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or partner is None:
            return None
        real = mask != 0
        partner = partner.to(real.device)
        return real, partner, mix_mask(real, partner, self.mask_mode)

    # ----------------------------------------------------------------- public API
    def capture_key(self, batch, *args):
        """Not defined for CAT: its key depends on the step's draws, which `plan_step` makes."""
        raise TypeError("CAT plans its steps: call plan_step(batch) (its key is StepPlan.key)")

    def plan_step(self, batch, *args):
        """The host-side part of the next step (`cat_fast.step.CapturedStep`): warm-up or not, the mixing layer,
        partners and λ drawn as `__call__` draws them (the same streams), and on a GPU in training mode the
        generators from which the counterfactual passes redraw the clean forward's dropout inside a graph
        (`models.rng.PassGenerators`). Advances ``step``: run the step with `planned_step`. Not replayable:
        the alternating update (it steps an optimizer inside the step)."""
        if self.update != "sum":
            raise NotCapturable("CAT(update='alternate') steps its CRM optimizer inside the step; run it with "
                                "CapturedStep(..., cuda_graph=False)")
        step = self.step
        self.step += 1
        if step < self.warmup_steps:
            return StepPlan(key=("erm",), state=None)
        m = self._draw_layer()
        B, device, param_dtype = self._batch_size(batch)
        host_partner = self._draw_host_partner(B)
        partner = self._to(host_partner, device)
        lam0 = self._draw_lambda(B, device, torch.promote_types(param_dtype, torch.float32))
        rng = None
        if device.type == "cuda" and self.model.training:
            rng = models.PassGenerators.for_batch(self._pass_rng, batch, device, self.adv_steps + 1, m)
        return StepPlan(key=("cat", m), state=(m, rng), tensors={"partner": partner, "lam0": lam0},
                        host={"partner": host_partner}, **(rng.plan_fields() if rng is not None else {}))

    def planned_step(self, plan, batch, *args):
        """``(loss, info)`` of the step `plan` describes (`plan_step`), eagerly or inside a CUDA-graph capture: the
        loss and info of `__call__` with the same draws."""
        if plan.key == ("erm",):
            return self._erm_only(batch)
        with torch.enable_grad():
            erm, cf, info = self._losses(batch, plan=plan)
        return erm + cf, info

    def __call__(self, batch):
        step = self.step
        self.step += 1
        if step < self.warmup_steps:
            return self._erm_only(batch)
        erm, cf, info = self.losses(batch)
        if self.update == "sum":
            return erm + cf, info
        self._crm_update(cf)
        erm, _ = self._erm_only(batch)
        info["erm_loss"] = erm.detach()
        return erm, info

    def losses(self, batch):
        """``(erm, cf, info)`` from one clean forward: ERM, counterfactual loss CRM (+ gs_weight · L_GS), info.

        Always runs the CAT branch (ignores warm-up and does not advance ``step``): for custom loops. Not for an
        objective built on a DistributedDataParallel model (its passes would run outside DDP's forward, and the
        ranks would drift): call the objective itself there."""
        if getattr(self, "ddp", None) is not None and not getattr(self, "_in_ddp_forward", False):
            raise RuntimeError("CAT.losses: this CAT was built on a DistributedDataParallel model, and losses() would "
                               "run outside DDP's forward (the ranks would drift): call the objective, "
                               "loss, info = cat(batch)")
        with torch.enable_grad():
            return self._losses(batch)

    # ----------------------------------------------------------------- steps of Algorithm 1
    def _losses(self, batch, plan=None):
        """One CAT step's losses. With a `plan` (`plan_step`): its layer, partners and λ, no CAL graphs of its own
        (the whole step is the graph, or runs eagerly), and inside a capture the counterfactual passes redraw the
        clean forward's dropout from the plan's generators. The passes share the 16-bit weight copies of the fast
        layers (`layers.casts.shared`)."""
        with casts.shared():
            return self._step_losses(batch, plan)

    def _step_losses(self, batch, plan):
        if plan is None:
            m = self._draw_layer()
        else:
            m, rng = plan.state
        # The clean forward prunes its last layer too (same logits), except under CAT + GS, whose double backward
        # through layers m+1..L needs the model's own attention.
        prune = self._prunes(batch) and self.gs_weight == 0
        # λ and the partners are drawn before the forward (they do not depend on it), so that the captured CAL
        # graphs can be replayed from inside it, as soon as h_m exists: the GPU runs the CAL steps while the host
        # is still issuing the clean forward's layers m+1..L (a forward at these sizes is bound by the host).
        B, device, param_dtype = self._batch_size(batch)
        if plan is None:
            partner = self._draw_partner(B, device)
            lam0 = self._draw_lambda(B, device, torch.promote_types(param_dtype, torch.float32))
            rng = None
        else:
            partner, lam0 = plan.tensors["partner"], plan.tensors["lam0"]
        # the rows CMIX reads, only where the step packs (not in the padded graphs and eager steps of "auto")
        packs = self.packs_rows and (training_layers.packed_mode() is True or packing.static_count() is not None)
        rows = self.packed_rows(batch, {"partner": partner}) if packs else None
        # past the mixing layer, the rows of the mixed sequences only (self: each call's real tokens, the keys)
        after = lent = None
        extended = rows is not None
        if extended:
            after = packing.KEYS if self.mask_mode == "self" else self.narrowed_rows(batch, {"partner": partner})
            if self.lent_rows_apart:  # up to h_m the real tokens packed, the lent rows carried apart
                lent = rows & (batch["attention_mask"] == 0).to(rows.device)
                rows = packing.KEYS
        with packing.extended(rows, after=after), packing.lent(lent):
            return self._extended_step_losses(batch, plan, m, rng, partner, lam0, prune, B, device, extended)

    def _extended_step_losses(self, batch, plan, m, rng, partner, lam0, prune, B, device, extended):
        capturing = plan is not None and rng is not None and torch.cuda.is_current_stream_capturing()
        if rng is not None:  # eager, or inside the capture: where the step's draws start
            rng.start()
        # the CAL graphs are captured padded: not where the clean forward packs its rows
        use_graphs = self.cuda_graph and self.detach_weight and plan is None and not extended
        early = {}

        def replay_early(cap):  # replays only a signature captured before (shapes and dtypes included)
            h_m = cap.hidden.detach()
            if CALGraphs.usable(h_m):
                early["replayed"] = self.graphs.run_captured(cap, h_m, lam0, partner, batch["labels"], None)

        on_hidden = replay_early if use_graphs and self.task.targets_before_forward else None
        if extended:  # layers m+1..L of every pass pack the mixed sequences' rows only (`narrowed_rows`)

            def on_hidden(cap):
                early["lent"] = packing.lent_rows()  # the lent rows of h_m, where carried apart
                packing.narrow()
        cap = models.capture(self.model, batch, m, first_token=prune, on_hidden=on_hidden, rng=not capturing,
                             training_layers=self.training_layers and self.gs_weight == 0)
        if rng is not None and not capturing:
            cap.rng_marker = rng.mark
        h = cap.hidden
        if h.shape[0] != B:
            raise ValueError(f"CAT: the batch has {B} samples, but the model's hidden states at layer {m} have batch "
                             f"size {h.shape[0]}")
        if h.device != device:  # a model spread over devices: λ and the partners go where h_m is
            device = h.device
            partner, lam0 = partner.to(device), lam0.to(device)
        targets, logits = self.task.targets(batch, cap.outputs)
        allow = self._qa_allow(batch, targets, h.shape[1], device)
        mask = cap.padding_mask

        replayed = early.get("replayed")
        if replayed is None and use_graphs and CALGraphs.usable(h):
            replayed = self.graphs.run(cap, h.detach(), lam0, partner, targets, allow)
        if replayed is not None:
            lam, cf_logits = replayed
        else:
            lent = early.get("lent")
            h_det = packing.with_lent(h, *lent) if lent is not None else h.detach()
            lam, cf_logits = self._cal(cap, lam0, partner, mask, allow, targets, rng if capturing else None, h_det)

        erm = self.task.erm(logits, targets)
        crm = self.task.crm(logits, cf_logits, targets, a1=self.a1, a2=self.a2, detach_weight=self.detach_weight)
        with torch.no_grad():
            objective = self.cal_objective_per_sample(cf_logits, targets).mean() - lam.abs().mean()
            weights = self.task.weights(logits, cf_logits, self.a1, self.a2)
        info = {
            "erm_loss": erm.detach(),
            "crm_loss": crm.detach(),
            "lambda_before": lam0.mean(),
            "lambda_after": lam.mean(),
            "crm_weight_mean": weights,
            "cal_objective": objective.detach(),
            "layer": torch.tensor(float(m)),
            "cat_active": torch.tensor(1.0),
        }
        cf = crm
        if self.gs_weight > 0:
            gs = self._gs_term(cap, logits, targets, partner, lam, mask)
            info["gs_loss"] = gs.detach()
            cf = crm + self.gs_weight * gs
        return erm, cf, info

    def _cal(self, cap, lam0, partner, mask, allow, targets, rng, h_det=None):
        """``(λ, counterfactual logits)`` without CUDA graphs: CAL's ascent steps on λ from `lam0`, then the final
        counterfactual pass on the optimised λ. `rng`: the plan's generators inside a whole-step capture (`_pass`).
        `h_det`: h_m detached (None: ``cap.hidden.detach()``), with the lent rows carried apart written in."""
        h = cap.hidden
        h_det = h.detach() if h_det is None else h_det
        # CAL: ascent on λ only; h_m detached, parameters untouched.
        lam = lam0.clone()
        for k in range(self.adv_steps):
            self.cal_ascent(cap, h_det, lam, partner, mask, allow, targets, within=self._pass(rng, k, cap))

        # Final counterfactual forward on the optimised λ (no autograd when ω is detached).
        differentiable = not self.detach_weight
        with torch.set_grad_enabled(differentiable), self._pass(rng, self.adv_steps, cap):
            cf_logits = self.counterfactual_logits(cap, h if differentiable else h_det, lam, partner, mask, allow,
                                                   input_grad_only=not differentiable)
        return lam, cf_logits

    def _gs_term(self, cap, logits, labels, partner, lam, mask):
        """GS on the CMIX pair (h_m, h̃_m): g = ∇_{h_m} f_{y_j}(h_i) (double backward), ĝ = h̃ − h (detached)."""
        h = cap.hidden
        score = logits.gather(1, labels[partner].unsqueeze(1)).sum()
        (g,) = torch.autograd.grad(score, h, create_graph=True, retain_graph=True)
        check_double_backward(g, self.model)
        with torch.no_grad():
            h_mix, _ = cmix(h.detach(), lam, partner)
            g_hat = h_mix - h
        valid = labels[partner] != labels
        return masked_mean(gs_cosine_loss(g, g_hat, reduction="none"), valid)

    @staticmethod
    def _pass(rng, k, cap):
        """Inside a whole-step capture (`rng`, a `models.PassGenerators`): counterfactual pass ``k`` draws from its
        own generator from the marker on, which redraws the clean forward's dropout masks of layers m+1..L (the
        eager pass restores the RNG state instead); the backward of a CAL step inside the block draws nothing (SDPA's
        dropout backward reads the seed and offset its forward wrote). Elsewhere nothing."""
        return rng.pass_(k, cap) if rng is not None else contextlib.nullcontext()

    def _erm_only(self, batch):
        with torch.enable_grad():
            if self._prunes(batch):
                outputs = models.first_token_forward(self.model, batch)
            else:
                outputs = self.plain_forward(models.model_inputs(batch))
            targets, logits = self.task.targets(batch, outputs)
            erm = self.task.erm(logits, targets)
        zero = torch.zeros((), device=erm.device, dtype=erm.dtype)
        info = {"erm_loss": erm.detach(), "crm_loss": zero, "lambda_before": zero, "lambda_after": zero,
                "crm_weight_mean": zero, "cal_objective": zero, "layer": torch.tensor(0.0),
                "cat_active": torch.tensor(0.0)}
        if self.gs_weight > 0:
            info["gs_loss"] = zero
        return erm, info

    def _crm_update(self, cf):
        if self.crm_optimizer is None:
            raise ValueError("update='alternate' needs crm_optimizer (CAT(..., crm_optimizer=opt) or cat.crm_optimizer = opt)")
        self.inner_update(cf, self.crm_optimizer)

    # ----------------------------------------------------------------- CMIX and CAL pieces (also `cat_graphs`)
    def cal_objective_per_sample(self, cf_logits, targets):
        return self.task.cal_objective(cf_logits, targets, self.gamma, self.eta)

    def cal_step(self, lam, grad):
        cal_step_(lam, grad, self.adv_lr, self.p)

    def cal_ascent(self, cap, h, lam, partner, mask, allow, targets, within=None):
        """One CAL step on λ, in place (docs/METHODS.md §1.2): the counterfactual pass from the detached `h` at
        `lam`, ∂J/∂λ, then `cal_step`. The eager loop (`_cal`) and the CUDA graph of the CAL loop (`cat_graphs`)
        both run it; `within`: the context of the pass and its backward (the plan's pass generators, the graph's
        autocast)."""
        with torch.enable_grad(), (within if within is not None else contextlib.nullcontext()):
            lam_var = lam.detach().requires_grad_(True)
            cf_logits = self.counterfactual_logits(cap, h, lam_var, partner, mask, allow)
            objective = self.cal_objective_per_sample(cf_logits, targets).sum()
            (grad,) = torch.autograd.grad(objective, lam_var)
        self.cal_step(lam, grad)

    def _prunes(self, batch):
        """Whether this model's last layer runs for the first token only (decided once per model, before any
        graph capture: `models.first_token_ready`)."""
        return self.prune_last_layer and self.task.first_token_head and models.first_token_ready(self.model, batch)

    def first_token(self, cap):
        return (self.prune_last_layer and self.task.first_token_head and cap.layer < self.structure.num_layers
                and models.first_token_ok(self.model, cap))

    def counterfactual_logits(self, cap, h, lam, partner, mask, allow, input_grad_only=True):
        coef = lam if allow is None else lam.unsqueeze(1) * allow
        h_mix, mask_mix = cmix(h, coef, partner, mask, self.mask_mode)
        first = self.first_token(cap)
        out = models.resume(self.model, cap, h_mix, attention_mask=None if self.mask_mode == "self" else mask_mix,
                            first_token=first, first_token_row_only=first,
                            input_grad_only=input_grad_only and self.fast_resume)
        return models.logits_of(out)

    def _qa_allow(self, batch, targets, T, device):
        """The [B, T] positions CMIX may mix for QA, None for classification (`cat_tasks`)."""
        return self.task.allow(self.model.config, batch, targets, T, device)

    def _batch_size(self, batch):
        """(B, device, parameter dtype) known before the forward: the batch's first tensor input and the model's
        first parameter (λ is drawn in the parameters' dtype promoted to float32, that of h_m)."""
        tensors = [v for v in models.model_inputs(batch).values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        if not tensors:
            raise ValueError("CAT: the batch has no tensor input for the model (input_ids, inputs_embeds, ...)")
        param = next(self.model.parameters())
        return tensors[0].shape[0], param.device, param.dtype
