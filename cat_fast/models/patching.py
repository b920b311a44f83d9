"""Swapping a module's forward for the length of a call, and reading and writing a layer call's arguments and
outputs (a tensor, or a tuple whose first item is the hidden state)."""
from __future__ import annotations

import torch

__all__ = ["patch_forward", "unpatch_forward", "first_of", "replace_first", "hidden_argument", "output_format",
           "formatted", "wants_all_outputs"]


def first_of(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def replace_first(out, h):
    if isinstance(out, tuple):
        return (h,) + tuple(out[1:])
    if isinstance(out, list):
        return [h] + list(out[1:])
    return h


def hidden_argument(args, kwargs):
    if args:
        return args[0], ("arg", 0)
    for name in ("hidden_states", "hidden_state", "x"):
        if isinstance(kwargs.get(name), torch.Tensor):
            return kwargs[name], ("kw", name)
    raise ValueError("cat_fast: cannot find the hidden-state argument of an encoder layer call")


def patch_forward(mod, fwd):
    """Set an instance-level ``forward`` on `mod`; returns what `_unpatch_forward` needs to undo it."""
    saved = (mod, "forward" in mod.__dict__, mod.__dict__.get("forward"))
    mod.forward = fwd
    return saved


def unpatch_forward(saved):
    mod, had, old = saved
    if had:
        mod.forward = old
    else:
        del mod.forward


def output_format(out):
    if isinstance(out, torch.Tensor):
        return None
    if isinstance(out, (tuple, list)) and out and all(v is None for v in out[1:]):
        return (type(out), len(out))
    return False


def formatted(fmt, row):
    if fmt is None:
        return row
    kind, n = fmt
    return kind((row,) + (None,) * (n - 1))


def wants_all_outputs(model, inputs):
    config = model.config
    return any(bool(getattr(config, k, False) if inputs.get(k) is None else inputs[k])
               for k in ("output_hidden_states", "output_attentions"))
