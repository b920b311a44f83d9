"""CAT — counterfactual adversarial training (Wang et al. 2021), the paper's Algorithm 1 (docs/METHODS.md §1).

``loss, info = CAT(model)(batch)`` for a Hugging Face ``*ForSequenceClassification`` or ``*ForQuestionAnswering``
model; `batch` is what the model takes plus ``labels`` (``start_positions`` / ``end_positions`` for QA). One call is
one training step: warm-up ERM, or CMIX at a drawn layer, CAL on λ and ERM + CRM (see `CAT` for the arguments).
On a GPU the CAL loop is replayed as CUDA graphs (`cat_graphs`).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from .. import models
from ..kernels.dtypes import upcast
from ..layers import casts
from ..ops import MASK_MODES, cal_objective, cal_step_, cmix, crm_loss, crm_weights, gs_cosine_loss
from ..step import NotCapturable, StepPlan
from .base import Objective, check_number, check_single_label
from .cat_graphs import CALGraphs
from .gs import check_double_backward, masked_mean

__all__ = ["CAT", "default_layers"]


def default_layers(num_layers: int) -> list:
    """The paper's {8, 9, 10}-of-12 mixing layers scaled to `num_layers` (module docstring)."""
    return sorted({min(num_layers, max(1, math.floor(k * num_layers / 12 + 0.5))) for k in (8, 9, 10)})


class CAT(Objective):
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

    Randomness: ``generator=None`` draws λ and partners on the model's device from the global RNG; a CPU
    ``torch.Generator`` makes every draw reproducible on any device. ``info`` holds detached 0-d tensors
    (``erm_loss``, ``crm_loss``, ``lambda_before``, ``lambda_after``, ``crm_weight_mean``, ``cal_objective``,
    ``layer``, ``cat_active``, and ``gs_loss`` with GS): no host synchronisation inside the step.
    """

    def __init__(self, model, layers=None, alpha=0.3, beta=0.3, gamma=10.0, eta=20.0, adv_steps=3, adv_lr=2e-2,
                 p=1.0, a1=0.0, a2=10.0, mask_mode="self", detach_weight=True, update="sum", warmup_steps=0,
                 partner="permutation", gs_weight=0.0, generator=None, crm_optimizer=None, cuda_graph=True,
                 max_graphs=8, prune_last_layer=True, fast_resume=True, training_layers=True):
        given, model = model, models.unwrap(model)  # `Objective` finds a torch.compile wrapper in `given`
        st = models.structure(model)
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
        super().__init__(given)
        self.structure = st
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
        self.qa = st.task == "question_answering"
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
        kw = dict(preset)
        for option, name in (("cat_layers", "layers"), ("alpha", "alpha"), ("beta", "beta"), ("gamma", "gamma"),
                             ("eta", "eta"), ("adv_steps", "adv_steps"), ("adv_lr", "adv_lr"),
                             ("mask_mode", "mask_mode"), ("cat_update", "update")):
            if options.get(option) is not None:
                kw[name] = options[option]
        if options.get("crm_clip") is not None:
            kw["a1"], kw["a2"] = options["crm_clip"]
        if kw.get("gs_weight", 0) > 0 and options.get("gs_weight") is not None:
            kw["gs_weight"] = options["gs_weight"]
        if options.get("seed") is not None and "generator" not in kw:
            kw["generator"] = torch.Generator().manual_seed(options["seed"])
        if kw.get("update") == "alternate" and kw.get("crm_optimizer") is None:
            # the paper's alternating step: a separate optimizer (lr 2e-5 in the paper) steps on CRM first
            kw["crm_optimizer"] = torch.optim.AdamW(model.parameters(), lr=options.get("crm_lr", 2e-5))
        return cls(model, **kw)

    def set_optimizer(self, optimizer):
        """The alternating update steps `optimizer` on CRM when no ``crm_optimizer`` was given."""
        if self.update == "alternate" and self.crm_optimizer is None:
            self.crm_optimizer = optimizer

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
        partner = self._draw_partner(B, device)
        lam0 = self._draw_lambda(B, device, torch.promote_types(param_dtype, torch.float32))
        rng = None
        if device.type == "cuda" and self.model.training:
            rng = models.PassGenerators.for_batch(self._pass_rng, batch, device, self.adv_steps + 1, m)
        return StepPlan(key=("cat", m), state=(m, rng), tensors={"partner": partner, "lam0": lam0},
                        **(rng.plan_fields() if rng is not None else {}))

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

        Always runs the CAT branch (ignores warm-up and does not advance ``step``): for custom loops."""
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
        capturing = plan is not None and rng is not None and torch.cuda.is_current_stream_capturing()
        if rng is not None and not capturing:
            rng.start()
        use_graphs = self.cuda_graph and self.detach_weight and plan is None
        early = {}

        def replay_early(cap):  # replays only a signature captured before (shapes and dtypes included)
            h_m = cap.hidden.detach()
            if CALGraphs.usable(h_m):
                early["replayed"] = self.graphs.run_captured(cap, h_m, lam0, partner, batch["labels"], None)

        on_hidden = replay_early if use_graphs and not self.qa else None
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
        targets, logits = self._targets(batch, cap.outputs, h.shape[1])
        allow = self._qa_allow(batch, targets, h.shape[1], device) if self.qa else None
        mask = cap.padding_mask

        h_det = h.detach()
        replayed = early.get("replayed")
        if replayed is None and use_graphs and CALGraphs.usable(h):
            replayed = self.graphs.run(cap, h_det, lam0, partner, targets, allow)
        if replayed is not None:
            lam, cf_logits = replayed
        else:
            # CAL: ascent on λ only; h_m detached, parameters untouched.
            lam = lam0.clone()
            for k in range(self.adv_steps):
                lam_var = lam.detach().requires_grad_(True)
                with self._pass(rng if capturing else None, k, cap):
                    cf_logits = self.counterfactual_logits(cap, h_det, lam_var, partner, mask, allow)
                    objective = self.cal_objective_per_sample(cf_logits, targets).sum()
                    (grad,) = torch.autograd.grad(objective, lam_var)
                self.cal_step(lam, grad)

            # Final counterfactual forward on the optimised λ (no autograd when ω is detached).
            differentiable = not self.detach_weight
            with torch.set_grad_enabled(differentiable), self._pass(rng if capturing else None, self.adv_steps, cap):
                cf_logits = self.counterfactual_logits(cap, h if differentiable else h_det, lam, partner, mask, allow,
                                            input_grad_only=not differentiable)

        erm = self._erm(logits, targets)
        crm = self._crm(logits, cf_logits, targets)
        with torch.no_grad():
            objective = self.cal_objective_per_sample(cf_logits, targets).mean() - lam.abs().mean()
            weights = self._weights(logits, cf_logits)
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
            targets, logits = self._targets(batch, outputs, None)
            erm = self._erm(logits, targets)
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

    # ----------------------------------------------------------------- task-specific pieces
    def _targets(self, batch, outputs, T):
        logits = models.logits_of(outputs)
        if not self.qa:
            return batch["labels"], logits
        T = logits[0].shape[1]
        s = batch["start_positions"].clamp(0, T - 1)
        e = batch["end_positions"].clamp(0, T - 1)
        return (s, e), logits

    def _erm(self, logits, targets):
        if not self.qa:
            return F.cross_entropy(upcast(logits), targets)
        return F.cross_entropy(upcast(logits[0]), targets[0]) + F.cross_entropy(upcast(logits[1]), targets[1])

    def _crm(self, logits, cf_logits, targets):
        kw = dict(a1=self.a1, a2=self.a2, detach_weight=self.detach_weight)
        if not self.qa:
            return crm_loss(logits, cf_logits, targets, **kw)
        return sum(crm_loss(z, zc, y, **kw) for z, zc, y in zip(logits, cf_logits, targets))

    def _weights(self, logits, cf_logits):
        if not self.qa:
            return crm_weights(logits, cf_logits, self.a1, self.a2).mean()
        return sum(crm_weights(z, zc, self.a1, self.a2).mean() for z, zc in zip(logits, cf_logits)) / 2

    def cal_objective_per_sample(self, cf_logits, targets):
        if not self.qa:
            return cal_objective(cf_logits, targets, self.gamma, self.eta)
        return sum(cal_objective(z, y, self.gamma, self.eta) for z, y in zip(cf_logits, targets))

    def cal_step(self, lam, grad):
        cal_step_(lam, grad, self.adv_lr, self.p)

    def _prunes(self, batch):
        """Whether this model's last layer runs for the first token only (decided once per model, before any
        graph capture: `models.first_token_ready`)."""
        return self.prune_last_layer and not self.qa and models.first_token_ready(self.model, batch)

    def first_token(self, cap):
        return (self.prune_last_layer and not self.qa and cap.layer < self.structure.num_layers
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
        cfg = self.model.config
        attn = batch.get("attention_mask")
        if "context_mask" in batch:
            context = batch["context_mask"].to(device).bool()
        elif "token_type_ids" in batch and getattr(cfg, "type_vocab_size", 1) > 1:
            context = batch["token_type_ids"] == 1
        else:
            sep = getattr(cfg, "sep_token_id", None)
            sep = getattr(cfg, "eos_token_id", None) if sep is None else sep
            if sep is None or "input_ids" not in batch:
                raise ValueError("CAT for QA cannot find the context: pass batch['context_mask'] (1 on context "
                                 "tokens), token_type_ids, or set config.sep_token_id")
            is_sep = batch["input_ids"] == sep
            context = (is_sep.cumsum(1) > 0) & ~is_sep
        pos = torch.arange(T, device=device)
        s, e = targets
        answer = (pos >= s.unsqueeze(1)) & (pos <= e.unsqueeze(1))
        allow = context & ~answer
        if attn is not None:
            allow = allow & (attn != 0)
        return allow.to(torch.float32)

    def _batch_size(self, batch):
        """(B, device, parameter dtype) known before the forward: the batch's first tensor input and the model's
        first parameter (λ is drawn in the parameters' dtype promoted to float32, that of h_m)."""
        tensors = [v for v in models.model_inputs(batch).values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        if not tensors:
            raise ValueError("CAT: the batch has no tensor input for the model (input_ids, inputs_embeds, ...)")
        param = next(self.model.parameters())
        return tensors[0].shape[0], param.device, param.dtype

    # ----------------------------------------------------------------- randomness
    def _draw_layer(self):
        if len(self.layers) == 1:
            return self.layers[0]
        gen = self.layer_generator if self.layer_generator is not None else self.generator
        idx = torch.randint(len(self.layers), (1,), generator=gen)  # CPU: no device sync
        return self.layers[int(idx)]

    def _draw_partner(self, B, device):
        gen = self.generator
        if self.partner == "permutation":
            if gen is not None:
                return torch.randperm(B, generator=gen).to(device, non_blocking=True)
            return torch.randperm(B, device=device)
        if gen is not None:
            return torch.randint(B, (B,), generator=gen).to(device, non_blocking=True)
        return torch.randint(B, (B,), device=device)

    def _draw_lambda(self, B, device, dtype):
        if self.generator is None:
            # Beta(α, β) as torch.distributions samples it (the first coordinate of a Dirichlet(α, β) draw: the
            # same kernel, the same random numbers) without building the distribution objects each step. The
            # concentrations are made with torch.full (no host-to-device copy, no sync) once per shape.
            key = (B, device, dtype)
            if self._concentration is None or self._concentration[0] != key:
                a = torch.full((B,), self.alpha, device=device, dtype=dtype)
                b = torch.full((B,), self.beta, device=device, dtype=dtype)
                self._concentration = (key, torch.stack([a, b], -1))
            return torch._sample_dirichlet(self._concentration[1]).select(-1, 0)
        seed = int(torch.randint(2**62, (1,), generator=self.generator))
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            lam = torch.distributions.Beta(torch.full((B,), self.alpha, dtype=dtype),
                                           torch.full((B,), self.beta, dtype=dtype)).sample()
        return lam.to(device, non_blocking=True)
