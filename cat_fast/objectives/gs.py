"""Gradient supervision (Teney et al. 2020): align the model's input gradient with counterfactual directions
(docs/METHODS.md §2).

``loss, info = GradientSupervision(model)(batch, pairs)``, ``pairs[i]`` = the index in the batch of sample i's
counterfactual (−1: none; `pair_by_group` builds it from group ids). ``loss = CE + weight · L_GS``, L_GS the mean
of ``1 − cos(g_i, ĝ_i)`` over samples whose partner has another label. See `GradientSupervision` for the arguments.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
import torch.nn.functional as F

from .. import models
from ..kernels.dtypes import upcast
from ..kernels.reference.pooled_gs_loss import partners as _partners
from ..kernels.reference.pooled_gs_loss import weighted_cosine_loss as _weighted_cosine_loss
from ..kernels.triton import optional
from ..layers import casts
from ..ops import gs_cosine_loss
from ..step import NotCapturable, StepPlan
from .base import Objective, check_number

__all__ = ["GradientSupervision", "pair_by_group", "double_backward_error", "DOUBLE_BACKWARD_HINT"]

DOUBLE_BACKWARD_HINT = (
    "gradient supervision mode='exact' needs a double backward through the model, but its attention kernel has "
    "none (derivative for aten::_scaled_dot_product_*_attention_backward is not implemented): load the model with "
    "attn_implementation=\"eager\", or run under torch.nn.attention.sdpa_kernel(SDPBackend.MATH), "
    "or use mode=\"first_order\""
)


def double_backward_error(exc):
    """Map PyTorch's "derivative for aten::_scaled_dot_product_*_attention_backward is not implemented" to a
    one-line RuntimeError that says how to fix it; None for any other exception."""
    text = str(exc)
    if "derivative for aten::_scaled_dot_product" in text and "not implemented" in text:
        return RuntimeError(DOUBLE_BACKWARD_HINT)
    return None


def has_missing_double_backward(t: torch.Tensor) -> bool:
    """True when the autograd graph of `t` holds a node whose backward is not implemented (PyTorch's
    ``NotImplemented`` node: differentiating `t` again would raise)."""
    fn = t.grad_fn
    if fn is None:
        return False
    stack, seen = [fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "NotImplemented" in node.name():
            return True
        stack.extend(f for f, _ in node.next_functions)
    return False


def check_double_backward(g: torch.Tensor, model) -> None:
    """Raise the one-line `DOUBLE_BACKWARD_HINT` error when `g` (built with create_graph through `model`'s
    attention) cannot be differentiated. Eager attention is plain matmuls and softmax, always twice
    differentiable: the graph walk (milliseconds of host time per step) runs only for other implementations."""
    if getattr(model.config, "_attn_implementation", None) == "eager":
        return
    if has_missing_double_backward(g):
        raise RuntimeError(DOUBLE_BACKWARD_HINT)


def pair_by_group(group_ids: torch.Tensor) -> torch.Tensor:
    """Pairs from group ids [B]: each sample's partner is the next sample (cyclically, in batch order) with the
    same id, -1 when alone. Groups of two give the symmetric pairing (i ↔ j). No host synchronisation."""
    ids = group_ids.reshape(-1)
    B = ids.shape[0]
    idx = torch.arange(B, device=ids.device)
    same = ids[:, None] == ids[None, :]
    same.fill_diagonal_(False)
    dist = (idx[None, :] - idx[:, None]) % B  # distance forward from i to j
    dist = torch.where(same, dist, torch.full_like(dist, B))
    best = dist.min(dim=1).values
    return torch.where(best < B, (idx + best) % B, torch.full_like(idx, -1))


def _random_pairs(B, device, generator):
    if B < 2:
        return torch.full((B,), -1, dtype=torch.long, device=device)
    if generator is not None:
        shift = torch.randint(1, B, (B,), generator=generator).to(device, non_blocking=True)
    else:
        shift = torch.randint(1, B, (B,), device=device)
    return (torch.arange(B, device=device) + shift) % B


def _parse_representation(rep):
    if rep == "pooled":
        return None
    if isinstance(rep, int):
        return rep
    if isinstance(rep, str) and rep.startswith("layer:"):
        return int(rep.split(":", 1)[1])
    raise ValueError(f"representation must be 'pooled', 'layer:K' or an int K, got {rep!r}")


def _fused_kernel():
    """`cat_fast.kernels.triton.pooled_gs_loss`, or None when Triton cannot be imported."""
    return optional("pooled_gs_loss")


def _info(ce, gs, pairs_used):
    """The detached 0-d tensors a call returns beside its loss."""
    return {"ce_loss": ce.detach(), "gs_loss": gs.detach(), "gs_pairs": pairs_used.to(ce.dtype)}


_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _check_pairs(pairs, batch_size):
    """``pairs`` must be an integer tensor [B] of partner indices in [-1, B) (-1: none). The range is read on CPU
    tensors, and on CUDA only with CAT_FAST_DEBUG=1 (it would synchronise the host with the device)."""
    if not isinstance(pairs, torch.Tensor):
        raise TypeError(f"pairs: expected an integer torch.Tensor of partner indices [B], got {type(pairs).__name__}")
    if pairs.dtype not in _INDEX_DTYPES:
        raise TypeError(f"pairs: expected an integer tensor (partner indices, -1 = none), got dtype "
                        f"{str(pairs.dtype).replace('torch.', '')}")
    if tuple(pairs.shape) != (batch_size,):
        raise ValueError(f"pairs: expected shape ({batch_size},) (one partner index per sample of the batch), got "
                         f"{tuple(pairs.shape)}")
    if pairs.numel() and (pairs.device.type == "cpu" or os.environ.get("CAT_FAST_DEBUG", "0") == "1") \
            and not torch.compiler.is_compiling():
        low, high = int(pairs.min()), int(pairs.max())
        if low < -1 or high >= batch_size:
            raise ValueError(f"pairs: expected partner indices in [-1, {batch_size}) (-1 = no partner), got values "
                             f"in [{low}, {high}]")


def masked_mean(values, valid):
    """Mean of `values` over `valid` rows (0 when none), without a host synchronisation."""
    w = valid.to(values.dtype)
    return (values * w).sum() / w.sum().clamp_min(1)


class GradientSupervision(Objective):
    """``loss, info = gs(batch, pairs)``: cross-entropy + ``weight`` · gradient-supervision loss.

    ``target="counterfactual"`` (default): ``g_i = ∇_x f_c(x_i)``, f_c the LOGIT of the partner's class c = y_j, and
    ``ĝ_i = x_j − x_i`` (detached); ``"factual"``: ``g_i = ∇_x CE(f(x_i), y_i)`` — for two classes that is
    ``p_{y_j} (∇f_{y_j} − ∇f_{y_i})``, not a multiple of the counterfactual g (§2.1). Each row supervises its own
    gradient: give both directions to apply GS at both members. ``representation="pooled"`` (the input of the
    classification projection; its first-token row for heads that take the sequence) or ``"layer:K"`` / ``K`` (the
    token states ``h_K``; pairs must be token-aligned) (§2.2). ``random_pairs=True``: the paper's ablation, a random
    other sample as partner.

    ``mode="exact"``: g with ``create_graph=True`` (double backward; an attention kernel without it is a one-line
    error, `DOUBLE_BACKWARD_HINT`); for the pooled vector of a linear head g = W[y_j] in closed form, and on CUDA
    the whole loss is one Triton kernel from the second call. ``mode="first_order"``: the parameter term by finite
    differences, ``difference="central"`` (two passes) or ``"forward"`` (one), step ``eps · ‖x_i‖ / ‖u_i‖``, on the
    clean forward's dropout masks; any attention kernel (§2.3). ``low_memory=True`` runs those passes inside the
    caller's ``backward()`` and accumulates their parameter gradients into ``.grad`` (use ``False`` with
    ``torch.autograd.grad``). ``prune_last_layer`` / ``training_layers``: the fast layers, as in `CAT`.
    ``info``: detached 0-d ``ce_loss``, ``gs_loss``, ``gs_pairs``.
    """

    def __init__(self, model, weight=1.0, representation="pooled", target="counterfactual", mode="exact",
                 random_pairs=False, eps=1e-3, generator=None, difference="central", low_memory=True,
                 prune_last_layer=True, training_layers=True):
        given, model = model, models.unwrap(model)  # `Objective` finds a torch.compile wrapper in `given`
        st = models.structure(model)
        if st.task != "sequence_classification":
            raise ValueError(f"GradientSupervision supports *ForSequenceClassification models, got {st.model_class}")
        if target not in ("counterfactual", "factual"):
            raise ValueError(f"target must be 'counterfactual' or 'factual', got {target!r}")
        if mode not in ("exact", "first_order"):
            raise ValueError(f"mode must be 'exact' or 'first_order', got {mode!r}")
        eps = check_number("eps", eps, low=0, low_open=True)
        weight = check_number("weight", weight, low=0)
        if difference not in ("central", "forward"):
            raise ValueError(f"difference must be 'central' or 'forward', got {difference!r}")
        layer = _parse_representation(representation)
        if layer is not None and not 0 <= layer <= st.num_layers:
            raise ValueError(f"representation layer must be in [0, {st.num_layers}], got {layer}")
        super().__init__(given)
        self.weight = float(weight)
        self.representation = representation
        self.layer = layer
        self.target = target
        self.mode = mode
        self.random_pairs = random_pairs
        self.eps = float(eps)
        self.generator = generator
        self._pass_rng = {}  # input shapes -> models.PassGenerators of planned first-order steps (`plan_step`)
        self.difference = difference
        self.low_memory = bool(low_memory)
        self.prune_last_layer = bool(prune_last_layer)
        self.training_layers = bool(training_layers)
        self.model_structure = st
        self._closed_form = None  # pooled exact g: closed form for a linear head (None: not checked yet)
        self._pooled_dtype = None  # dtype of the pooled vector on the last call (that of the closed-form g)

    needs_pairs = True

    def check_distributed(self):
        if self.mode == "first_order" and self.low_memory:
            raise ValueError("low_memory=True (mode='first_order') cannot train under DistributedDataParallel: its "
                             "perturbed passes write the parameters' .grad from a hook inside the backward, outside "
                             "DDP's reducer, so those gradients would not be averaged over the ranks; pass "
                             "low_memory=False")

    @classmethod
    def from_options(cls, model, options, **preset):
        """GS from the CLI's options: ``gs_weight`` (the weight), ``gs_representation`` ("pooled" or a layer
        number), ``gs_mode``, ``gs_difference`` and ``seed`` (a CPU generator for random pairs)."""
        kw = dict(preset)
        if options.get("gs_weight") is not None:
            kw.setdefault("weight", options["gs_weight"])
        rep = options.get("gs_representation")
        if rep is not None:
            rep = str(rep).strip()
            if rep != "pooled" and not rep.isdigit():
                raise ValueError(f"gs_representation: expected 'pooled' or a layer number such as 0, got {rep!r}")
            kw.setdefault("representation", rep if rep == "pooled" else int(rep))
        for option, name in (("gs_mode", "mode"), ("gs_difference", "difference")):
            if options.get(option) is not None:
                kw.setdefault(name, options[option])
        if options.get("seed") is not None and "generator" not in kw:
            kw["generator"] = torch.Generator().manual_seed(options["seed"])
        return cls(model, **kw)

    def _score(self, logits, labels, partner):
        """Per-sample scalar whose x-gradient is g: the partner-class logit, or the factual CE."""
        if self.target == "counterfactual":
            return logits.gather(1, labels[partner].unsqueeze(1)).squeeze(1)
        z = upcast(logits)
        return F.cross_entropy(z, labels, reduction="none")

    def capture_key(self, batch, *args):
        """``()``: nothing selects a graph besides the batch's shapes (`plan_step` plans the step itself)."""
        self._check_capturable()
        return ()

    def _check_capturable(self):
        if self.mode == "first_order" and self.low_memory:
            raise NotCapturable("first-order GradientSupervision with low_memory=True writes .grad from a hook inside "
                                "the backward; pass low_memory=False")

    def plan_step(self, batch, *args):
        """The host-side part of the next step (`cat_fast.step.CapturedStep`): random pairs drawn as `__call__` draws
        them, and for first-order GS on a GPU in training mode the generators from which its perturbed passes redraw
        the clean forward's dropout inside a graph (`models.PassGenerators`). Not replayable: first-order with
        ``low_memory=True`` (it writes ``.grad`` from a hook inside the backward)."""
        self._check_capturable()
        labels = batch["labels"]
        tensors = {}
        if self.random_pairs:
            tensors["pairs"] = _random_pairs(labels.shape[0], labels.device, self.generator)
        rng = None
        if self.mode == "first_order" and labels.is_cuda and self.model.training:
            passes = 2 if self.difference == "central" else 1
            rng = models.PassGenerators.for_batch(self._pass_rng, batch, labels.device, passes)
        return StepPlan(key=("gs",), state=rng, tensors=tensors, **(rng.plan_fields() if rng is not None else {}))

    def planned_step(self, plan, batch, pairs=None):
        """``(loss, info)`` of the step `plan` describes (`plan_step`), eagerly or inside a CUDA-graph capture."""
        return self._step(batch, pairs, plan)

    def __call__(self, batch, pairs=None):
        return self._step(batch, pairs, None)

    def _step(self, batch, pairs, plan):
        with casts.shared():  # the clean forward and the perturbed passes share the fast layers' 16-bit weights
            return self._step_in_scope(batch, pairs, plan)

    def _step_in_scope(self, batch, pairs, plan):
        labels = batch["labels"]
        if pairs is None and not self.random_pairs:
            pairs = batch.get("pairs")
            if pairs is None:
                raise ValueError("GradientSupervision needs pairs (argument or batch['pairs']) unless random_pairs=True")
        B = labels.shape[0]
        device = labels.device
        if self.random_pairs:
            pairs = _random_pairs(B, device, self.generator) if plan is None else plan.tensors["pairs"]
        else:
            _check_pairs(pairs, B)
        pairs = pairs.to(device=device, dtype=torch.long)
        rng = plan.state if plan is not None else None
        capturing = rng is not None and torch.cuda.is_current_stream_capturing()
        if rng is not None and not capturing:
            rng.start()

        pooled = self.layer is None
        with torch.enable_grad():
            exact = self.mode == "exact"
            kernel = self._pooled_kernel(labels) if pooled and exact else None
            # Pooled, exact, linear head (checked on the first call): g = W[y_j] is known before the forward. On
            # CUDA the whole loss is one kernel after the forward (`triton.pooled_gs_loss`); else g and the row
            # weights are computed before the forward (where the host work overlaps the previous step's GPU work).
            partner = partner_labels = valid = early = None
            if kernel is None:
                partner, partner_labels, valid = _partners(pairs, labels)
                early = self._pooled_closed_form(partner_labels, valid) if pooled and exact else None
            prune = (self.prune_last_layer and (pooled or not exact)
                     and models.first_token_ready(self.model, batch))
            cap = models.capture(self.model, batch, None if pooled else self.layer, pooled=pooled,
                                 rng=not exact and not capturing, first_token=prune,
                                 training_layers=self.training_layers and (pooled or not exact))
            if rng is not None and not capturing:
                cap.rng_marker = rng.mark
            x = cap.pooled if pooled else cap.hidden
            logits = models.logits_of(cap.outputs)
            z = upcast(logits)
            ce = F.cross_entropy(z, labels)
            head = self.model_structure.head  # an nn.Linear wherever `kernel` is set (the checked closed form)
            if kernel is not None and self._pooled_dtype == x.dtype and kernel.supported(head.weight, x):
                gs, pairs_used = kernel.pooled_gs_loss(head.weight, x, pairs, labels)
                return torch.add(ce, gs, alpha=self.weight), _info(ce, gs, pairs_used)
            if partner is None:
                partner, partner_labels, valid = _partners(pairs, labels)
            g_hat = (x.index_select(0, partner) - x).detach()
            if early is not None and self._pooled_dtype == x.dtype:
                g, weights, weight_sum, pairs_used = early
                gs = _weighted_cosine_loss(g, g_hat, weights, weight_sum)
                return torch.add(ce, gs, alpha=self.weight), _info(ce, gs, pairs_used)
            if pooled:
                g = self._linear_head_gradient(cap, logits, labels, partner) if exact else None
                if g is None:
                    g = models.grad_wrt_pooled(self._score(logits, labels, partner).sum(), cap, create_graph=exact)
                self._pooled_dtype = x.dtype
            else:
                score = self._score(logits, labels, partner).sum()
                (g,) = torch.autograd.grad(score, x, create_graph=exact, retain_graph=True)
            if exact:
                if not pooled:  # the pooled representation's g differentiates only the head: no attention
                    check_double_backward(g, self.model)
                gs = masked_mean(gs_cosine_loss(g, g_hat, reduction="none"), valid)
                loss = ce + self.weight * gs
            else:
                gs, term = self._first_order(cap, x, g.detach(), g_hat, logits, labels, partner, valid, pooled,
                                              prune, rng if capturing else None)
                loss = ce + self.weight * (gs.detach() + term)
        return loss, _info(ce, gs, valid.sum())

    def _pooled_kernel(self, labels):
        """`triton.pooled_gs_loss` when the pooled exact loss can run as one kernel (the closed form checked on an
        earlier call, the counterfactual target, CUDA tensors, Triton importable), else None."""
        ready = (self._closed_form is True and self.target == "counterfactual" and self._pooled_dtype is not None
                 and labels.is_cuda)
        return _fused_kernel() if ready else None

    def _pooled_closed_form(self, partner_labels, valid):
        """``(g, row weights, their sum, number of pairs)`` of the pooled exact loss, computed before the forward
        once the closed form has been checked (`_linear_head_gradient`), for the counterfactual target; else None.
        g = W[y_j] in float32 (float64 for a float64 model) after rounding to the dtype the pooled vector had on
        the previous call (bf16 under autocast), as `_linear_head_gradient` gives it."""
        if self._closed_form is not True or self.target != "counterfactual" or self._pooled_dtype is None:
            return None
        acc = torch.promote_types(self._pooled_dtype, torch.float32)
        g = self.model_structure.head.weight.index_select(0, partner_labels).to(self._pooled_dtype).to(acc)
        rows = valid.to(acc)
        count = rows.sum()
        weights = rows / count.clamp_min(1)
        return g, weights, weights.sum(), count

    def _linear_head_gradient(self, cap, logits, labels, partner):
        """g in closed form when the head is one nn.Linear on the [B, D] pooled vector (BERT, DistilBERT, ALBERT,
        DeBERTa-v2): ∇_x f_c = W[c]; ∇_x CE = (softmax − onehot) W. Same value as the autograd double backward,
        without its host work. Checked once against autograd per instance; None when not applicable."""
        head = self.model_structure.head
        x = cap.head_input
        if self._closed_form is False or not isinstance(head, torch.nn.Linear) or x is None or x.dim() != 2:
            return None
        weight = head.weight
        if self.target == "counterfactual":
            g = weight.index_select(0, labels[partner])
        else:
            z = upcast(logits)
            probs = torch.softmax(z, dim=-1) - F.one_hot(labels, z.shape[-1]).to(z.dtype)
            g = probs @ weight.to(z.dtype)
        if self._closed_form is None:  # first call: the model's logits must be exactly head(x)
            reference = models.grad_wrt_pooled(self._score(logits, labels, partner).sum(), cap, create_graph=False)
            tol = 1e-2 if reference.dtype in (torch.float16, torch.bfloat16) else 1e-4
            self._closed_form = bool(torch.allclose(g.detach().to(reference.dtype), reference, rtol=tol, atol=tol))
            if not self._closed_form:
                return None
        return g.to(x.dtype)  # autograd's g has the dtype of x (bf16 under autocast)

    def _first_order(self, cap, x, g, g_hat, logits, labels, partner, valid, pooled, prune, rng=None):
        """``(L_GS, term)``: `term` has value 0 and gradient ``∇_θ (uᵀ∇_x f_c)`` by finite differences. `rng` (inside
        a whole-step capture, a `models.PassGenerators`): perturbed pass k redraws the clean forward's dropout from
        its own generator."""
        g_var = g.requires_grad_(True)
        gs = masked_mean(gs_cosine_loss(g_var, g_hat, reduction="none"), valid)
        (u,) = torch.autograd.grad(gs, g_var)
        rows = x.shape[0]
        x_norm = x.detach().reshape(rows, -1).norm(dim=1)
        u_norm = u.reshape(rows, -1).norm(dim=1)
        tiny = torch.finfo(u.dtype).tiny ** 0.5
        eps_i = self.eps * x_norm / u_norm.clamp_min(tiny)
        shape = (rows,) + (1,) * (x.dim() - 1)
        step = (eps_i.reshape(shape) * u).to(x.dtype)
        central = self.difference == "central"
        denom = (2 * eps_i if central else eps_i).to(x.dtype)
        signs = (1.0, -1.0) if central else (1.0,)

        def scorer(capture):
            def score_at(x_new):
                if pooled:
                    out = models.head_logits(self.model, capture, x_new)
                else:
                    out = models.logits_of(models.resume(self.model, capture, x_new, first_token=prune,
                                                         first_token_row_only=prune,
                                                         training_layers=self.training_layers))
                return (self._score(out, labels, partner) / denom).sum()
            return score_at

        # The clean pass of a forward difference is the clean forward itself (its graph is already there).
        clean = -(self._score(logits, labels, partner) / denom).sum() if not central else x.new_zeros(())
        clean = clean - clean.detach()
        target = cap.head_input if pooled else x
        if not (self.low_memory and target.requires_grad):
            score_at = scorer(cap)
            perturbed = 0
            for k, sign in enumerate(signs):
                with rng.pass_(k, cap) if rng is not None else contextlib.nullcontext():
                    perturbed = perturbed + sign * score_at(x + sign * step)
            return gs.detach(), clean + perturbed - perturbed.detach()
        # The hook lives on target's autograd node: it must not hold tensors of the clean graph (a reference
        # cycle through that node would outlive the step), hence a detached copy of the capture.
        score_at = scorer(_detached(cap))
        return gs.detach(), clean + _deferred_passes(target, x.detach(), step, signs, score_at, pooled, self.model)


def _detached(cap):
    def detach(v):
        if isinstance(v, torch.Tensor):
            return v.detach()
        if isinstance(v, (tuple, list)):
            return type(v)(detach(t) for t in v)
        return v

    return dataclasses.replace(cap, hidden=detach(cap.hidden), outputs=None, layer_outputs=detach(cap.layer_outputs),
                               embedding_output=detach(cap.embedding_output), head_input=detach(cap.head_input),
                               pooled=None, last_output=detach(cap.last_output))


class _ScaleProbe(torch.autograd.Function):
    """Zero-valued scalar attached to `target`; its backward records the incoming gradient (weight × loss
    scale) before `target`'s own gradient is complete (it is one of target's consumers)."""

    @staticmethod
    def forward(ctx, target, box):
        ctx.box = box
        return target.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        ctx.box["scale"] = grad
        return None, None


def _deferred_passes(target, x0, step, signs, score_at, pooled, model):
    """Low-memory first-order GS: the perturbed passes run INSIDE the caller's backward, once the gradient of
    `target` (x, or the head input holding it) is complete — the clean forward's upper graph is freed by then,
    so at most one perturbed graph is alive. Each pass is a forward + backward of ``scale · Σ ±f(x ± εu)/d``:
    its parameter gradients are accumulated into ``.grad`` directly, its input gradient is added to target's."""
    device_type = target.device.type
    autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
    box = {}
    params = [p for p in model.parameters() if p.requires_grad]

    def hook(grad):
        scale = box.pop("scale", None)
        if scale is None:  # a backward that does not differentiate the GS term
            return None
        extra = torch.zeros_like(x0)
        with torch.enable_grad(), torch.autocast(device_type, dtype=autocast[1], enabled=autocast[0]):
            for sign in signs:
                xp = (x0 + sign * step).requires_grad_(True)
                objective = score_at(xp) * (sign * scale.to(torch.float32))
                torch.autograd.backward(objective, inputs=[xp] + params)
                extra += xp.grad
        if pooled and grad.dim() == 3:  # the head takes the sequence: x is its first-token row
            grad = grad.clone()
            grad[:, 0] += extra.to(grad.dtype)
            return grad
        return grad + extra.to(grad.dtype)

    target.register_hook(hook)
    return _ScaleProbe.apply(target, box)
