"""The model directories cat-fast writes, loaded by transformers alone: a trained classifier in a pipeline with its
label names, and a masked one (cat-fast mask) whose README says how to load it masked."""
import json

import pytest
import torch

from .conftest import run

transformers = pytest.importorskip("transformers")


def test_trained_model_loads_in_a_pipeline_with_its_label_names(tiny, tmp_path, capsys):
    out = tmp_path / "erm"
    code, err = run(["train", "--task", "sentiment", "--method", "erm", "--model", tiny, "--per-class", 4, "--epochs",
                     1, "--max-length", 32, "--batch-size", 8, "--out", out], capsys)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {"0": "Negative", "1": "Positive"}
    assert config["label2id"] == {"Negative": 0, "Positive": 1}
    classify = transformers.pipeline("text-classification", model=str(out), device="cpu")
    got = classify(["a great film", "an awful film"], top_k=None)
    assert all({d["label"] for d in scores} == {"Negative", "Positive"} for scores in got)


def _masked(tiny, tmp_path, capsys):
    """`cat-fast mask` of the tiny model, its top neurons those of a made-up analysis: layer 1's output."""
    from cat_fast import models
    from cat_fast.analysis import masking, nie_file
    from cat_fast.analysis.mediation import NeuronEffects
    from cat_fast.models.pretrained import load_classifier

    model, _ = load_classifier(tiny)
    effects = {(layer, c): torch.zeros(masking.component_width(model, layer, c))
               for layer in (1, 2) for c in models.COMPONENTS}
    effects[(1, "output")] = torch.linspace(1, 2, effects[(1, "output")].numel())
    nie_file.save(str(tmp_path / "nie.pt"), NeuronEffects(effects), model, {"top_k": 16})
    out = tmp_path / "masked"
    code, err = run(["mask", "--model", tiny, "--nie", tmp_path / "nie.pt", "--out", out], capsys)
    assert code == 0, err
    return out


def test_masked_directory_says_how_to_load_it(tiny, tmp_path, capsys):
    from cat_fast.analysis.masking import CONFIG_KEY, load_masked

    out = _masked(tiny, tmp_path, capsys)
    readme = (out / "README.md").read_text()
    assert "cat_fast.analysis.masking" in readme and "load_masked(" in readme
    assert "16 neurons" in readme and CONFIG_KEY in readme and "from_pretrained" in readme
    assert len(json.loads((out / "config.json").read_text())[CONFIG_KEY]["neurons"]) == 16

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    batch = tokenizer(["a great film", "an awful film with a poor plot"], padding=True, return_tensors="pt")
    masked, _ = load_masked(str(out))
    plain = transformers.AutoModelForSequenceClassification.from_pretrained(out)
    original = transformers.AutoModelForSequenceClassification.from_pretrained(tiny)
    with torch.no_grad():
        logits = {name: m.eval()(**batch).logits for name, m in (("masked", masked), ("plain", plain),
                                                                  ("original", original))}
    torch.testing.assert_close(logits["plain"], logits["original"])  # from_pretrained: the weights, unmasked
    assert (logits["masked"] - logits["plain"]).abs().max() > 1e-4
