"""Interventions on a layer's activations that every path honours: the model's own modules and cat_fast's fast layers.

``with intervene(layer, "intermediate", fn): ...`` replaces the layer's feed-forward activation ``a`` by ``fn(a)``
inside the block (components: `layout.COMPONENTS`). It is a forward hook on the component's module (so the model's
own code runs it), marked so that the fast layers (`training`, `resumed`, `first_token`) do not refuse the layer
for it but call `fn` themselves at the same point of their computation. ``fn`` gets ``[B, T, width]`` — the rows the
layer computes: all T tokens, or row 0 only (T = 1) in a first-token last layer — and returns a tensor of that shape;
it is differentiated by autograd like any other op. Use it for neuron masking, activation patching and mediation.
"""
from __future__ import annotations

import weakref

from torch import nn

from . import layout

__all__ = ["intervene", "active", "apply"]

# layer module -> {component: [fn, ...]} while interventions are registered
_ACTIVE: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def _hook(fn):
    def hook(module, args, output):
        return fn(output)

    hook.cat_fast_intervention = True  # recognised by `layout.plain`: the fast layers apply `fn` themselves
    return hook


class intervene:
    """Apply ``fn`` to `component`'s activation of encoder layer module `layer` inside the block (module docstring).

    A plain context manager, not a generator: one entered and never left (a mask kept on a model) has no finaliser
    to run at interpreter exit."""

    def __init__(self, layer: nn.Module, component: str, fn):
        if not callable(fn):
            raise TypeError(f"fn: expected a callable (tensor -> tensor), got {type(fn).__name__}")
        self.layer, self.component, self.fn = layer, component, fn
        self.module = layout.component(layer, component)
        self._handle = None

    def __enter__(self):
        if self._handle is not None:
            raise RuntimeError("intervene: this block is in effect already (enter it once)")
        self._handle = self.module.register_forward_hook(_hook(self.fn))
        _ACTIVE.setdefault(self.layer, {}).setdefault(self.component, []).append(self.fn)
        return None

    def __exit__(self, *exc):
        if self._handle is None:
            return False
        self._handle.remove()
        self._handle = None
        entry = _ACTIVE.get(self.layer, {})
        fns = entry.get(self.component, [])
        if self.fn in fns:
            fns.remove(self.fn)
        if not fns:
            entry.pop(self.component, None)
        if not entry:
            _ACTIVE.pop(self.layer, None)
        return False


def active(layer: nn.Module):
    """The interventions registered on `layer` ({component: [fn, ...]}), or None (one dictionary lookup)."""
    return _ACTIVE.get(layer)


def apply(found, component: str, x):
    """`x` after the interventions `found` (from `active`) registers for `component`, in registration order."""
    if found:
        for fn in found.get(component, ()):
            x = fn(x)
    return x
