"""The per-family table (`cat_fast.layers.layout.LAYOUTS`, read through `cat_fast.models.families`): every entry
complete and right for its models, and the one place that knows a family — a new entry is picked up by
recognition, interventions, masking, unlearning, mediation and the first-token layer, and no other module names a
family or one of its module paths."""
import ast
import dataclasses
import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cat_fast import models
from cat_fast.analysis import masking, unlearning
from cat_fast.analysis import mediation as M
from cat_fast.layers import first_token, layout
from cat_fast.models import families
from tests.conftest import tiny_batch, tiny_model

PACKAGE = pathlib.Path(models.__file__).resolve().parent.parent
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
ARCHS = ("bert", "roberta", "electra", "distilbert")


def _layer_output(layer, x):
    out = layer(x)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("kind", sorted(layout.LAYOUTS))
def test_every_family_fills_every_field(kind):
    spec = layout.LAYOUTS[kind]
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if f.name in ("norms", "chunking"):  # may be empty: no LayerNorm to check, the layer itself
            continue
        assert value is not None and value != "" and value != (), f"{kind}.{f.name} is empty"
    assert set(spec.producers) == set(layout.COMPONENTS)
    assert all(linear for linear, _ in spec.producers.values())
    for name in ("attention_block", "activation", "output_block", "feed_forward"):
        assert callable(getattr(spec, name)), f"{kind}.{name}"
    assert isinstance(spec.fused, bool)


@pytest.mark.parametrize("arch", ARCHS)
def test_table_entry_matches_the_model(arch):
    """Each tiny model's layers are recognised as the family that lists its model type; every path of the entry
    resolves (producers: a Linear and a LayerNorm or None); the row-wise pieces compute the layer's output."""
    model = tiny_model(arch, dtype=torch.float64).eval()
    layer = models.structure(model).layer_modules[0]
    kind = families.family(layer)
    assert kind is not None and model.config.model_type in layout.LAYOUTS[kind].model_types
    assert families.config_family(model.config) == kind
    spec = layout.LAYOUTS[kind]
    for comp in layout.COMPONENTS:
        assert isinstance(families.component(layer, comp), nn.Module)
        linear, norm = families.producer(layer, comp)
        assert isinstance(linear, nn.Linear) and (norm is None or isinstance(norm, nn.LayerNorm))
        assert families.component_width(layer, comp) == (64 if comp == "intermediate" else 32)
    assert families.inner_size(model.config) == 64 and getattr(model.config, spec.inner_size) == 64
    x = torch.randn(2, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    parts = layout.pieces(layer)
    context = parts.attend(parts.query(x), parts.key(x), parts.value(x), None)
    want = _layer_output(layer, x)
    torch.testing.assert_close(parts.finish(context, x), want)
    a = parts.attended(context, x)
    torch.testing.assert_close(parts.output(parts.intermediate(a), a), want)


# ----------------------------------------------------------------------------------------- a family added in a test
class _Mix(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, h = config.hidden_size, config.num_attention_heads
        self.config, self.heads, self.head_dim = config, h, d // h
        self.scaling = self.head_dim ** -0.5
        self.dropout = nn.Dropout(0.0)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d) for _ in range(4))


class _FakeLayer(nn.Module):
    """A post-LN encoder layer whose parts have names no family of the table uses."""

    def __init__(self, config):
        super().__init__()
        d, i = config.hidden_size, config.intermediate_size
        self.mix = _Mix(config)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.up, self.act, self.down = nn.Linear(d, i), nn.GELU(), nn.Linear(i, d)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, **kwargs):
        x, a = hidden_states, self.mix
        b, t, d = x.shape
        q, k, v = (m(x).view(b, t, a.heads, a.head_dim).transpose(1, 2) for m in (a.wq, a.wk, a.wv))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.sdpa_mask(attention_mask, q.dtype),
                                                 scale=a.scaling).transpose(1, 2).reshape(b, t, d)
        h = self.norm1(a.wo(context) + x)
        return self.norm2(self.down(self.act(self.up(h))) + h)


FAKE = layout.Layout(
    model_types=("fake",), linears=("mix.wq", "mix.wk", "mix.wv", "mix.wo", "up", "down"), norms=("norm1", "norm2"),
    required=("act",), chunking="", attention="mix", heads="heads", head_width="head_dim",
    query="mix.wq", key="mix.wk", value="mix.wv", attention_output="norm1", intermediate="act", output="norm2",
    producers={"query": ("mix.wq", None), "key": ("mix.wk", None), "value": ("mix.wv", None),
               "attention_output": ("mix.wo", "norm1"), "intermediate": ("up", None), "output": ("down", "norm2")},
    attention_block=lambda layer, context, x: layer.norm1(layer.mix.wo(context) + x),
    activation=lambda layer, a: layer.act(layer.up(a)),
    output_block=lambda layer, i, a: layer.norm2(layer.down(i) + a),
    feed_forward=lambda layer, a: layer.norm2(layer.down(layer.act(layer.up(a))) + a),
    inner_size="intermediate_size", fused=False)


def _fake_model():
    model = tiny_model("bert", attn="sdpa", dtype=torch.float64)
    torch.manual_seed(1)
    model.bert.encoder.layer = nn.ModuleList([_FakeLayer(model.config) for _ in range(3)]).to(torch.float64)
    return model.eval()


def test_a_new_family_entry_is_picked_up_everywhere(monkeypatch):
    """One table entry (FAKE) makes a layer of a new structure known to recognition, interventions and masking
    (`component`), unlearning (`producer`), mediation's fast path and the first-token layer (`Pieces`)."""
    model = _fake_model()
    batch = {k: v for k, v in tiny_batch("bert", batch=4).items() if k in INPUTS}
    layer = models.structure(model).layer_modules[0]
    assert families.family(layer) is None and not first_token.supported(layer) and M._fast_ops(model) is None
    monkeypatch.setitem(layout.LAYOUTS, "fake", FAKE)
    assert families.family(layer) == "fake"
    assert families.component(layer, "intermediate") is layer.act
    # masking: widths from the producers, the mask applied through the component modules
    assert masking.component_width(model, 1, "intermediate") == 64
    assert masking.component_width(model, 2, "attention_output") == 32
    before = model(**batch).logits
    masking.mask_neurons(model, [(1, "intermediate", 5), (3, "output", 2)])
    assert not torch.equal(model(**batch).logits, before)
    masking.unmask_neurons(model)
    # unlearning: the producing rows
    got = {id(p): idx.tolist() for p, idx in unlearning.producing_parameters(model, [(1, "attention_output", 3),
                                                                                     (2, "intermediate", 5)])}
    lay2 = models.structure(model).layer_modules[1]
    want = {id(p): [3] for p in (layer.mix.wo.weight, layer.mix.wo.bias, layer.norm1.weight, layer.norm1.bias)}
    want.update({id(p): [5] for p in (lay2.up.weight, lay2.up.bias)})
    assert got == want
    # first token: the last layer for row 0 gives the model's logits
    assert first_token.supported(layer) and models.first_token_ready(model, batch)
    # mediation: the fast path runs on the pieces and agrees with the one-forward-per-neuron reference
    ops = M._fast_ops(model)
    assert ops is not None and ops[0].query is layer.mix.wq
    zbar = M.treatment_means(model, {k: v[:2] for k, v in batch.items()}, layers=[2, 3])
    zbar = {k: v + torch.randn(v.shape, dtype=v.dtype, generator=torch.Generator().manual_seed(2))
            for k, v in zbar.items()}
    fast = M.neuron_effects(model, batch, zbar, target_class=1, max_tokens=600)  # 16 copies a pass
    chosen = {k: [0, v.numel() - 1] for k, v in zbar.items()}
    ref = M.neuron_effects_looped(model, batch, zbar, target_class=1, neurons=chosen)
    for key, idx in chosen.items():
        torch.testing.assert_close(fast.effects[key][idx], ref.effects[key][idx], rtol=1e-6, atol=1e-12)


# ------------------------------------------------------------------------------------- no family knowledge elsewhere
def _strings(path):
    return {node.value for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Constant)
            and isinstance(node.value, str)}


def test_no_module_but_the_table_names_a_family():
    """No string naming a family, one of its model types or a dotted module path of its entry appears in any module
    of the package but `layers/layout.py` (the table)."""
    names = set(layout.LAYOUTS) | {t for spec in layout.LAYOUTS.values() for t in spec.model_types}
    for spec in layout.LAYOUTS.values():
        paths = [spec.attention, *spec.linears, *spec.norms, *spec.required, spec.chunking,
                 *(getattr(spec, c) for c in layout.COMPONENTS), *(p for pair in spec.producers.values() for p in pair)]
        names |= {p for p in paths if p and ("." in p or "_" in p)}
    found = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "layers/layout.py":
            continue
        hits = _strings(path) & names
        if hits:
            found[rel] = sorted(hits)
    assert not found, f"per-family knowledge outside the table: {found}"


def test_analysis_reaches_models_only_through_models():
    """No analysis module imports `cat_fast.layers` (nor anything below `models`)."""
    for path in (PACKAGE / "analysis").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = "." * node.level + (node.module or "")
                assert not any(module.startswith(p) for p in ("..layers", "..ops", "..kernels", "cat_fast.layers")), \
                    f"{path.name} imports {module}"


@pytest.mark.parametrize("arch", ["bert", "roberta", "distilbert"])
def test_max_length_leaves_out_the_positions_before_the_first_token(arch):
    """RoBERTa-style position ids start after the padding index (recognised by the position table's padding index,
    no model-type list): their longest input is that many positions shorter."""
    from cat_fast.cli.common import CliError
    from cat_fast.cli.train import check_max_length

    model = tiny_model(arch)
    table = next(m for n, m in model.named_modules() if n.endswith("position_embeddings"))
    longest = table.num_embeddings - (0 if table.padding_idx is None else table.padding_idx + 1)
    assert (arch == "roberta") == (longest < table.num_embeddings)
    check_max_length(longest, model, pairs=False)
    with pytest.raises(CliError, match=f"at most {longest}"):
        check_max_length(longest + 1, model, pairs=False)
