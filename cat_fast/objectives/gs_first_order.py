"""First-order gradient supervision (``mode="first_order"``, docs/METHODS.md §2.3): the parameter term of L_GS by
finite differences on the clean forward's dropout masks, any attention kernel. A mixin of `gs.GradientSupervision`
(``eps``, ``difference``, ``low_memory``, ``training_layers``, ``model`` and ``_score``); with ``low_memory`` the
perturbed passes run inside the caller's backward (`_deferred_passes`).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from .. import models
from ..layers import packing
from ..ops import gs_cosine_loss
from .gs_pairs import masked_mean

__all__ = ["FirstOrder", "EPS", "EPS_FLOAT64", "EPS_16_BIT", "step_size"]

# The relative step ``eps`` when none is given: the finite difference of a logit between x ± eps·‖x‖·u/‖u‖. Its error
# is the truncation, growing with the step, plus the rounding of the two passes divided by the step; the two balance
# near the cube root of the unit roundoff (float64 about 6e-6, fp32 5e-3, 10 mantissa bits as in TF32 and fp16 0.1).
# In fp32 a step of 1e-3 left backends apart by their rounding (3e-5 of gradients of 0.5), 1e-2 by 4e-6 with the
# same agreement with the exact term; where matmuls round to 16 bits, 1e-3 is mostly noise (docs/METHODS.md §2.3).
EPS = 1e-2
EPS_FLOAT64 = 1e-3
EPS_16_BIT = 0.1


def step_size(eps, x) -> float:
    """The relative step of a call: `eps` when given, else by the precision of the matmuls on `x`: `EPS_16_BIT`
    where they round to 16-bit precision (16-bit x, autocast to a 16-bit dtype on x's device, or fp32 on CUDA with
    TF32 matmuls allowed: TF32 keeps fp16's 10 mantissa bits, and the CLI allows it on GPUs), `EPS_FLOAT64` for a
    float64 x, else `EPS` (fp32)."""
    if eps is not None:
        return eps
    half = (torch.float16, torch.bfloat16)
    device_type = x.device.type
    low = x.dtype in half or (torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) in half)
    low = low or (x.is_cuda and x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32)
    if low:
        return EPS_16_BIT
    return EPS_FLOAT64 if x.dtype == torch.float64 else EPS


class FirstOrder:
    """`GradientSupervision`'s first-order pass (module docstring)."""

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
        eps_i = step_size(self.eps, x) * x_norm / u_norm.clamp_min(tiny)
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
    refused = packing.refused()  # the passes pack as the clean forward did, outside its step's scope

    def hook(grad):
        scale = box.pop("scale", None)
        if scale is None:  # a backward that does not differentiate the GS term
            return None
        extra = torch.zeros_like(x0)
        with packing.padded(refused), torch.enable_grad(), torch.autocast(device_type, dtype=autocast[1],
                                                                            enabled=autocast[0]):
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
