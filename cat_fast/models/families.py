"""The per-family table as the analyses read it: what they know about an encoder layer comes from here.

The table itself is `cat_fast.layers.layout.LAYOUTS` (one `Layout` per family; adding a family is one entry there
and its tests). This module gives it to the layers above `models` by layer number or module: the mediator modules
(`component`), the parameters that produce a neuron (`producer`, `component_width`), a layer in row-wise pieces
(`layer_pieces`, `Pieces`), and what a layer call passed (`call_arguments`).
"""
from __future__ import annotations

from torch import nn

from .. import layers
from ..layers.layout import LAYOUTS, Layout, Pieces, call_arguments, component, config_family, family
from .structure import structure

__all__ = ["Layout", "LAYOUTS", "Pieces", "family", "config_family", "component", "producer", "component_width",
           "layer_pieces", "call_arguments", "inner_size"]


def producer(layer: nn.Module, name: str) -> tuple:
    """``(linear, norm or None)`` of encoder layer module `layer`: the Linear whose output row makes each neuron of
    the mediator `name` and the LayerNorm after it (attention_output, output)."""
    return layers.layout.producer(layer, name)


def component_width(layer: nn.Module, name: str) -> int:
    """The number of neurons of the mediator `name` in encoder layer module `layer`: its producing Linear's width."""
    linear, _ = producer(layer, name)
    return int(linear.out_features)


def inner_size(config) -> int | None:
    """The feed-forward width of a Hugging Face config: its family's attribute (`Layout.inner_size`), or for a model
    type of no family the first attribute of the table's families that it has; None when it has none."""
    kind = config_family(config)
    names = [LAYOUTS[kind].inner_size] if kind is not None else [spec.inner_size for spec in LAYOUTS.values()]
    for name in dict.fromkeys(names):
        value = getattr(config, name, None)
        if value:
            return int(value)
    return None


def layer_pieces(model) -> list | None:
    """`Pieces` of every encoder layer of `model` when each can run in pieces now, else None: one module per layer,
    each of a `LAYOUTS` family the first-token layer supports (absolute positions, SDPA or eager attention), with no
    forward hooks or replaced forwards on its parts (`layout.plain`: calling them in pieces computes what the layer
    computes) and no interventions registered."""
    st = structure(model)
    if len(st.layer_modules) != st.num_layers:
        return None
    for layer in st.layer_modules:
        if (not layers.first_token.supported(layer) or layers.interventions.active(layer) is not None
                or not layers.layout.plain(*layer.modules())):
            return None
    return [Pieces(layer, family(layer)) for layer in st.layer_modules]
