"""The first-token decision: whether a model's head reads only row 0 of the last layer, so that the last layer can
run for that row only (`layers.first_token`) with the same logits; decided once per model."""
from __future__ import annotations

import torch

from . import fast_layers
from .capture import Capture, capture, resume
from .inputs import eval_no_grad, logits_close, logits_of, model_inputs, sync_free_inputs
from .patching import output_format
from .structure import orig_module, structure, uncompiled

__all__ = ["first_token_ok", "first_token_ready", "first_token_forward"]


def first_token_ok(model, cap: Capture) -> bool:
    """Whether ``resume(..., first_token=True)`` is exact for `model` (module docstring); decided once per model
    on the first capture with ``m < L`` (two no-grad resumes of that batch and one host synchronisation)."""
    model = orig_module(model)
    st = structure(model)
    known = fast_layers.first_token_known(model, st)
    if known is not None:
        return known
    if cap.layer >= st.num_layers or cap.last_output is None:
        return False  # no layer to run after h_m here: decide on a later capture
    fmt = output_format(cap.last_output)
    h = cap.hidden.detach()
    with eval_no_grad(model, h.device.type):
        full = logits_of(resume(model, cap, h))
        pruned = logits_of(resume(model, cap, h, first_token=True, first_token_fill=float("nan")))
    half = next(model.parameters()).dtype in (torch.float16, torch.bfloat16)
    tol = 2e-2 if half else 1e-4
    ok = fmt is not False and bool(torch.isfinite(pruned).all()) and logits_close(pruned, full, rtol=tol, atol=tol)
    fast_layers.record_first_token(model, ok, fmt)
    return ok


def first_token_ready(model, batch) -> bool:
    """`first_token_ok` for `model`, decided if needed on a capture of `batch` below the last layer (eval mode,
    no autograd: one extra forward, once per model, drawing no random numbers)."""
    model = orig_module(model)
    st = structure(model)
    known = fast_layers.first_token_known(model, st)
    if known is not None:
        return known
    device = next(model.parameters()).device
    with eval_no_grad(model, device.type):
        cap = capture(model, batch, st.num_layers - 1, rng=False)
    return first_token_ok(model, cap)


def first_token_forward(model, batch, *, training_layers: bool = False):
    """The model's own forward on `batch` (targets left out) with its last layer run for the first token only
    when `first_token_ready` accepts the model: the same logits and gradients as ``model(**inputs)`` with about
    5/6 of the last layer's matmuls skipped. For plain fine-tuning loops; the other models run unchanged.
    ``training_layers=True``: the other encoder layers run `layers.training` where it supports them (the same
    values and gradients with less host work; no double backward through them)."""
    model = orig_module(model)
    st = structure(model)
    inputs = sync_free_inputs(model, model_inputs(batch))
    ready = first_token_ready(model, batch)
    with fast_layers.training_layers(model, st, inputs, training_layers, carry=True), \
            fast_layers.last_layer_first_token(model, st, inputs, ready), uncompiled(model) as module:
        return module(**inputs)
