"""Recognition of a layer's family from the table (`layout.family`): what a family's entry requires, and the
layers no family covers (chunked feed-forward, cross-attention, missing parts)."""
import pytest
from torch import nn

from cat_fast import models
from cat_fast.layers import layout
from tests.conftest import tiny_model


@pytest.mark.parametrize("arch, kind", [("bert", "bert"), ("roberta", "bert"), ("electra", "bert"),
                                        ("distilbert", "distilbert")])
def test_family_of_each_layer(arch, kind):
    model = tiny_model(arch, num_layers=1)
    assert layout.family(models.structure(model).layer_modules[0]) == kind
    assert layout.MODEL_TYPES[model.config.model_type] == kind == layout.config_family(model.config)


@pytest.mark.parametrize("arch", ["bert", "distilbert"])
def test_layers_no_family_covers(arch):
    """A chunked feed-forward, cross-attention or a replaced projection: no family (the model's own layer runs)."""
    layer = models.structure(tiny_model(arch, num_layers=1)).layer_modules[0]
    chunked = layer if arch == "bert" else layer.ffn
    chunked.chunk_size_feed_forward = 4
    assert layout.family(layer) is None
    chunked.chunk_size_feed_forward = 0
    layer.add_cross_attention = True
    assert layout.family(layer) is None
    del layer.add_cross_attention
    assert layout.family(layer) == arch
    spec = layout.LAYOUTS[arch]
    *parent, name = spec.query.split(".")
    owner = layer.get_submodule(".".join(parent))
    setattr(owner, name, nn.Identity())
    assert layout.family(layer) is None and layout.pieces(layer) is None
    with pytest.raises(ValueError, match="no layout cat_fast knows"):
        layout.component(layer, "query")
