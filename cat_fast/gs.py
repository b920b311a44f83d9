"""Gradient supervision (SPEC §2; Teney et al. 2020): align the input-gradient of the model with counterfactual directions.

``loss, info = GradientSupervision(model, ...)(batch, pairs)``; ``pairs`` int64 [B]: index in the batch of each
sample's counterfactual partner, -1 for none. ``loss = CE(batch) + weight * L_GS``, with ``L_GS`` the mean of
``1 - cos(g_i, ĝ_i)`` over the samples that have a partner with a DIFFERENT label (same-label pairs are not
counterfactual and are skipped; with no usable pair ``L_GS = 0``). ``info`` maps names to detached 0-d tensors
(``ce_loss``, ``gs_loss``, ``gs_pairs``); log them with ``{k: float(v) for k, v in info.items()}``.

Conventions (``x`` is the representation, ``j = pairs[i]``):

* ``target="counterfactual"`` (default, SPEC): ``g_i = ∇_x f_c(x_i)`` with ``f_c`` the LOGIT of class ``c = y_j``
  (the partner's label) and ``ĝ_i = x_j − x_i``: the gradient of the partner's class must point toward the partner.
* ``target="factual"`` (the "negative factual loss" variant of a public re-implementation):
  ``g_i = +∇_x CE(f(x_i), y_i)``, ``ĝ_i = x_j − x_i``. Sign choice: ``∇_x CE(y_i) = Σ_c p_c ∇f_c − ∇f_{y_i}``
  points away from class ``y_i`` (toward the other classes), so with the same ``ĝ`` both conventions push the
  input-gradient toward the partner; for two classes they differ only by the positive factor ``p_{y_j}``.
* The relation is undirected but each row only supervises its own gradient: give both directions
  (``pairs[i] = j`` and ``pairs[j] = i``) to apply GS at both members; `pair_by_group` does that from group ids.
* ``ĝ`` is a detached target (the GS term moves the gradient toward the counterfactual direction, not the
  representations toward the gradient).
* ``representation="pooled"``: ``x`` = the input of the classification projection (first-token row when the
  head takes the sequence: RoBERTa, ELECTRA; see `cat_fast.models`). In train mode this vector is taken after
  the head's dropout where the model applies one (BERT), so ``ĝ`` carries that dropout noise.
  ``representation="layer:K"`` or int ``K``: token-level hidden state ``h_K`` (``K = 0`` is the embedding output
  = input of layer 1); pairs must be token-aligned (same padded length; e.g. CMIX pairs).
* ``random_pairs=True`` (paper's ablation): every sample gets a uniformly random OTHER sample of the batch as
  partner (the ``pairs`` argument is ignored); the same-label rule then applies as above.

Modes:

* ``mode="exact"``: ``g`` by ``torch.autograd.grad(create_graph=True)``, so ``L_GS`` is differentiated exactly
  (double backward). An attention kernel without double backward (sdpa flash / memory-efficient / cuDNN on GPU,
  flash on CPU) is detected right away by inspecting the graph of ``g`` and raises a one-line ``RuntimeError``
  that says how to fix it (`DOUBLE_BACKWARD_HINT`). `double_backward_error` maps PyTorch's own message the same
  way, for a ``backward()`` that fails later. For the pooled representation with a linear head (BERT, DistilBERT,
  ALBERT, DeBERTa-v2), ``g = W[y_j]`` in closed form (checked once against autograd on the first call); from the
  second call on CUDA the counterfactual-target loss and its weight gradient are one Triton kernel after the
  forward (`cat_fast.triton.pooled_gs_loss`), in place of ~45 small ops whose host time a small-batch step waits
  for.
* ``mode="first_order"`` (SPEC §2): ``g`` without a graph; ``u = ∂L_GS/∂g`` from the op's backward; the parameter
  term ``∇_θ(uᵀ∇_x f_c)`` is replaced by ``∇_θ Σ_i [f_c(x_i + ε_i u_i) − f_c(x_i − ε_i u_i)] / (2 ε_i)`` (``x`` not
  detached, so the lower layers get their term too), with ``ε_i = eps · ‖x_i‖ / ‖u_i‖`` per sample (the
  perturbation has norm ``eps·‖x_i‖`` whatever the scale of ``x``). It is added as a surrogate whose value is zero
  and whose gradient is that term: the loss VALUE is still ``CE + weight·L_GS``. The two extra passes re-run only
  the head (pooled) or layers ``K+1..L`` (layer K) on the same dropout masks as the clean forward. It needs no
  double backward, so it works with any attention kernel.
  ``difference="forward"``: ``[f_c(x_i + ε_i u_i) − f_c(x_i)] / ε_i`` instead — ONE perturbed pass, the clean pass
  is the clean forward itself (FLOP floor at h_0: 7/3 ≈ 2.33× a plain step instead of 10/3 for central); error
  O(ε) instead of O(ε²).
  ``prune_last_layer=True`` (default): in first-order mode and for the pooled representation, every pass (the
  clean forward and the perturbed passes) runs the last layer for the first token only when the model allows it
  (`cat_fast.models.first_token_ready`; the CAT module docstring): the same values with ~1/6 of that layer's
  matmuls, and the perturbed passes still draw the clean forward's dropout masks. Exact mode at a token-level
  representation runs the full layer (its double backward needs the model's own attention).
  ``low_memory=True`` (default): the perturbed passes run inside the caller's ``loss.backward()``, when the
  gradient of x is complete, one after the other — the clean graph above x is freed by then, so at most one
  perturbed graph is alive (peak memory close to a plain step instead of up to three graphs). Their parameter
  gradients are accumulated into ``.grad`` directly (scaled by the gradient that reaches the loss, so AMP loss
  scaling applies); ``torch.autograd.grad(loss, params)`` does not see them, and neither do DDP's gradient hooks
  in order: use ``low_memory=False`` (the passes as part of the loss's graph) for those.
  ``training_layers=True`` (default): the encoder layers run as `cat_fast.training_layer` where it supports them
  (Bert layout, SDPA) in the clean forward and the perturbed passes (first-order mode) and in the clean forward of
  exact mode at the pooled representation: the same values, dropout draws and gradients with less host and GPU
  work than the model's own modules (``g``'s input-only backward skips their weight-gradient matmuls, as the
  model's own autograd nodes do). Exact mode at a token-level representation keeps the model's layers: it needs
  their double backward.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from . import models
from .ops import gs_cosine_loss
from .triton import optional

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


def _partners(pairs, labels):
    """(partner index clamped at 0, the partner's label, whether the row has a counterfactual partner) [B]."""
    partner = pairs.clamp_min(0)
    partner_labels = labels.index_select(0, partner)
    return partner, partner_labels, (pairs >= 0) & (partner_labels != labels)


def _fused_kernel():
    """`cat_fast.triton.pooled_gs_loss`, or None when Triton cannot be imported."""
    return optional("pooled_gs_loss")


def _info(ce, gs, pairs_used):
    """The detached 0-d tensors a call returns beside its loss."""
    return {"ce_loss": ce.detach(), "gs_loss": gs.detach(), "gs_pairs": pairs_used.to(ce.dtype)}


def _weighted_cosine_loss(g, g_hat, weights, weight_sum, eps=1e-8):
    """``Σ_i weights_i (1 − cos(g_i, ĝ_i)) = Σ_i weights_i − weights · cos`` for [B, D] rows, norms clamped below
    at eps, in the dtype of `g` (float32 for 16-bit `g_hat`): `gs_cosine_loss` then `masked_mean`, with one
    composite op instead of a custom-op call — at [B, D] the work is a few microseconds and the host time of the
    calls is what counts."""
    cos = F.cosine_similarity(g, g_hat.to(g.dtype), dim=1, eps=eps)
    return weight_sum - torch.dot(weights, cos)


def masked_mean(values, valid):
    """Mean of `values` over `valid` rows (0 when none), without a host synchronisation."""
    w = valid.to(values.dtype)
    return (values * w).sum() / w.sum().clamp_min(1)


class GradientSupervision:
    """``loss, info = gs(batch, pairs)``: cross-entropy + ``weight`` · gradient-supervision loss (module docstring)."""

    def __init__(self, model, weight=1.0, representation="pooled", target="counterfactual", mode="exact",
                 random_pairs=False, eps=1e-3, generator=None, difference="central", low_memory=True,
                 prune_last_layer=True, training_layers=True):
        st = models.structure(model)
        if st.task != "sequence_classification":
            raise ValueError(f"GradientSupervision supports *ForSequenceClassification models, got {st.model_class}")
        if target not in ("counterfactual", "factual"):
            raise ValueError(f"target must be 'counterfactual' or 'factual', got {target!r}")
        if mode not in ("exact", "first_order"):
            raise ValueError(f"mode must be 'exact' or 'first_order', got {mode!r}")
        if eps <= 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        if difference not in ("central", "forward"):
            raise ValueError(f"difference must be 'central' or 'forward', got {difference!r}")
        layer = _parse_representation(representation)
        if layer is not None and not 0 <= layer <= st.num_layers:
            raise ValueError(f"representation layer must be in [0, {st.num_layers}], got {layer}")
        self.model = model
        self.weight = float(weight)
        self.representation = representation
        self.layer = layer
        self.target = target
        self.mode = mode
        self.random_pairs = random_pairs
        self.eps = float(eps)
        self.generator = generator
        self.difference = difference
        self.low_memory = bool(low_memory)
        self.prune_last_layer = bool(prune_last_layer)
        self.training_layers = bool(training_layers)
        self.model_structure = st
        self._closed_form = None  # pooled exact g: closed form for a linear head (None: not checked yet)
        self._pooled_dtype = None  # dtype of the pooled vector on the last call (that of the closed-form g)

    def _score(self, logits, labels, partner):
        """Per-sample scalar whose x-gradient is g: the partner-class logit, or the factual CE."""
        if self.target == "counterfactual":
            return logits.gather(1, labels[partner].unsqueeze(1)).squeeze(1)
        z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        return F.cross_entropy(z, labels, reduction="none")

    def __call__(self, batch, pairs=None):
        labels = batch["labels"]
        if pairs is None and not self.random_pairs:
            pairs = batch.get("pairs")
            if pairs is None:
                raise ValueError("GradientSupervision needs pairs (argument or batch['pairs']) unless random_pairs=True")
        B = labels.shape[0]
        device = labels.device
        if self.random_pairs:
            pairs = _random_pairs(B, device, self.generator)
        pairs = pairs.to(device=device, dtype=torch.long)

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
            cap = models.capture(self.model, batch, None if pooled else self.layer, pooled=pooled, rng=not exact,
                                 first_token=prune, training_layers=self.training_layers and (pooled or not exact))
            x = cap.pooled if pooled else cap.hidden
            logits = models.logits_of(cap.outputs)
            z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
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
                                              prune)
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
            z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
            probs = torch.softmax(z, dim=-1) - F.one_hot(labels, z.shape[-1]).to(z.dtype)
            g = probs @ weight.to(z.dtype)
        if self._closed_form is None:  # first call: the model's logits must be exactly head(x)
            reference = models.grad_wrt_pooled(self._score(logits, labels, partner).sum(), cap, create_graph=False)
            tol = 1e-2 if reference.dtype in (torch.float16, torch.bfloat16) else 1e-4
            self._closed_form = bool(torch.allclose(g.detach().to(reference.dtype), reference, rtol=tol, atol=tol))
            if not self._closed_form:
                return None
        return g.to(x.dtype)  # autograd's g has the dtype of x (bf16 under autocast)

    def _first_order(self, cap, x, g, g_hat, logits, labels, partner, valid, pooled, prune):
        """``(L_GS, term)``: `term` has value 0 and gradient ``∇_θ (uᵀ∇_x f_c)`` by finite differences."""
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
                                                         training_layers=self.training_layers))
                return (self._score(out, labels, partner) / denom).sum()
            return score_at

        # The clean pass of a forward difference is the clean forward itself (its graph is already there).
        clean = -(self._score(logits, labels, partner) / denom).sum() if not central else x.new_zeros(())
        clean = clean - clean.detach()
        target = cap.head_input if pooled else x
        if not (self.low_memory and target.requires_grad):
            score_at = scorer(cap)
            perturbed = sum(sign * score_at(x + sign * step) for sign in signs)
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
