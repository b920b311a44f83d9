"""nie.pt (cat_fast.analysis.nie_file): plain contents, and refused for any model but the one it was measured on."""
import copy

import pytest
import torch

from cat_fast import models
from cat_fast.analysis import masking, nie_file
from cat_fast.analysis.mediation import NeuronEffects
from tests.conftest import tiny_model


def _effects(model, fill=None):
    out = {}
    for comp in models.COMPONENTS:
        width = masking.component_width(model, 2, comp)
        out[(2, comp)] = torch.linspace(-1, 1, width) if fill is None else torch.full((width,), fill)
    return NeuronEffects(out, target_class=1, n_samples=6)


def test_round_trip_with_weights_only_and_the_model_record(tmp_path):
    model = tiny_model("bert")
    path = str(tmp_path / "nie.pt")
    nie_file.save(path, _effects(model), model, {"top_k": 5, "model": "runs/x", "bf16": False})
    raw = torch.load(path, weights_only=True)
    assert raw["model_shape"] == {"layers": 3, "widths": {"query": [32] * 3, "key": [32] * 3, "value": [32] * 3,
                                                         "attention_output": [32] * 3, "intermediate": [64] * 3,
                                                         "output": [32] * 3}}
    assert raw["model_fingerprint"] == nie_file.fingerprint(model) and raw["model_mask"] == ""
    assert raw["top_k"] == 5 and raw["model"] == "runs/x"
    effects, record = nie_file.load(str(tmp_path), model)  # the directory finds nie.pt
    assert effects.top(1)[0][:2] == (2, "query") and effects.flat()[0].numel() == 5 * 32 + 64
    assert record["top_k"] == 5
    nie_file.load(path, copy.deepcopy(model))  # the same weights in another object


def test_another_model_is_refused(tmp_path):
    model = tiny_model("bert")
    path = str(tmp_path / "nie.pt")
    nie_file.save(path, _effects(model), model)
    smaller = tiny_model("bert", num_layers=2)
    with pytest.raises(nie_file.NieFileError, match=r"3 layers \(query 32, .*intermediate 64, output 32\); this model "
                                                    r"has 2 layers"):
        nie_file.load(path, smaller)
    other = tiny_model("bert", seed=1)
    with pytest.raises(nie_file.NieFileError, match="another model of the same shape"):
        nie_file.load(path, other)
    masked = copy.deepcopy(model)
    masking.mask_neurons(masked, [(1, "query", 0)])
    with pytest.raises(nie_file.NieFileError, match="measured with the neuron mask none"):
        nie_file.load(path, masked)
    nudged = copy.deepcopy(model)
    with torch.no_grad():
        nudged.classifier.bias[0] += 1e-6
    with pytest.raises(nie_file.NieFileError, match="another model of the same shape"):
        nie_file.load(path, nudged)


def test_a_file_without_the_model_record_is_checked_by_its_widths_and_refused(tmp_path):
    model = tiny_model("bert")
    path = str(tmp_path / "nie.pt")
    torch.save({"effects": {"2.query": torch.zeros(48)}, "top_k": 1}, path)  # as older versions wrote it
    with pytest.raises(nie_file.NieFileError, match="layer 2 query width 48; this model has 3 layers"):
        nie_file.load(path, model)
    torch.save({"effects": {"2.query": torch.zeros(32)}, "top_k": 1}, path)
    with pytest.raises(nie_file.NieFileError, match="no fingerprint of the model"):
        nie_file.load(path, model)
    nie_file.load(path)  # without a model: only the effects are checked


@pytest.mark.parametrize("fill, words", [(float("nan"), "non-finite effects"), (float("inf"), "non-finite effects")])
def test_non_finite_or_no_effects_are_refused(tmp_path, fill, words):
    model = tiny_model("bert")
    path = str(tmp_path / "nie.pt")
    nie_file.save(path, _effects(model, fill), model)
    with pytest.raises(nie_file.NieFileError, match=f"nie.pt: 224 {words}"):
        nie_file.load(path, model)
    nie_file.save(path, NeuronEffects({}), model)
    with pytest.raises(nie_file.NieFileError, match="nie.pt: no neuron effects"):
        nie_file.load(path, model)
    with pytest.raises(nie_file.NieFileError, match="no nie.pt"):
        nie_file.load(str(tmp_path / "missing"))
    (tmp_path / "bad.pt").write_text("not a torch file")
    with pytest.raises(nie_file.NieFileError, match="bad.pt: cannot read it"):
        nie_file.load(str(tmp_path / "bad.pt"))
