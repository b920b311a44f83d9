"""Interventions on a model's neurons by layer number: ``with intervene(model, 3, "intermediate", fn): ...``.

The model's own layers and cat_fast's fast layers all apply ``fn`` (`cat_fast.layers.interventions`), so a
capture, resume or first-token forward inside the block sees the edited activations. Components:
`cat_fast.layers.layout.COMPONENTS`; ``fn`` maps the component's ``[B, T, width]`` activation to a tensor of that
shape (T = 1 in a first-token last layer). A compiled model is refused: its compiled graph would not run the
hooks in the forward calls made inside the block.
"""
from __future__ import annotations

from .. import layers
from .structure import is_compiled, structure, unsupported, unwrap

__all__ = ["intervene", "COMPONENTS"]

COMPONENTS = layers.layout.COMPONENTS


def intervene(model, layer: int, component: str, fn):
    """Context manager: apply ``fn`` to `component`'s activation in encoder layer `layer` (1-indexed) of `model`."""
    if is_compiled(model) or is_compiled(unwrap(model)):
        unsupported(unwrap(model), "it is compiled (torch.compile / model.compile()): interventions are forward hooks "
                                   "on its modules, which the compiled graph would not run; pass the uncompiled model")
    st = structure(model)
    if len(st.layer_modules) != st.num_layers:
        raise ValueError(f"layer: {st.model_class} runs one module for several layers ({st.layer_list_name}); "
                         "interventions by layer number need one module per layer")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer <= st.num_layers:
        raise ValueError(f"layer: expected an integer in [1, {st.num_layers}] for {st.model_class}, got {layer!r}")
    return layers.interventions.intervene(st.layer_modules[layer - 1], component, fn)
