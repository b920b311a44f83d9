"""Loading a classifier for eval / mask / unlearn / mediation / train: labels matched by name, no randomly drawn head
outside training, a saved neuron mask applied (or refused) by every command, the nie file checked against the
model, and the numbers of mediation / mask / unlearn checked."""
import json
import os
import shutil

import pytest
import torch

from cat_fast.analysis import masking
from cat_fast.models.pretrained import ModelLoadError, load_classifier

from .conftest import TOKENIZER_FILES, run, write

transformers = pytest.importorskip("transformers")

NLI = ("entailment", "neutral", "contradiction")


def _save(model, directory, tokenizer_dir):
    model.save_pretrained(directory)
    for f in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer_dir, f)):
            shutil.copy(os.path.join(tokenizer_dir, f), os.path.join(directory, f))
    return str(directory)


def _bert(tiny, num_labels, names=None, layers=2, hidden=32, seed=0, init=0.02):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                                  intermediate_size=2 * hidden, max_position_embeddings=512, num_labels=num_labels,
                                  initializer_range=init)
    if names:
        cfg.id2label = dict(enumerate(names))
        cfg.label2id = {n: i for i, n in enumerate(names)}
    return transformers.BertForSequenceClassification(cfg)


def _always(model, index):
    """`model` made to predict class `index` for every input."""
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.zero_()
        model.classifier.bias[index] = 5.0
    return model


@pytest.fixture(scope="module")
def nli_dir(tiny, tmp_path_factory):
    """A 3-way NLI classifier (random weights, larger than BERT's init so that neuron effects are well above
    rounding) with the MiniLM tokenizer."""
    return _save(_bert(tiny, 3, NLI, init=0.3), tmp_path_factory.mktemp("nli"), tiny)


# ------------------------------------------------------------------ eval: labels by name


def test_eval_matches_the_data_labels_to_the_model_by_name(tiny, tmp_path, capsys):
    model_dir = _save(_always(_bert(tiny, 2, ("neg", "pos")), 1), tmp_path / "m", tiny)
    data = write(tmp_path / "ev.tsv", [("text", "label"), ("a good film", "pos"), ("a great plot", "pos")])
    cols = ["--text-column", "text", "--label-column", "label", "--eval", f"ev={data}"]
    code, err = run(["eval", "--model", model_dir, "--labels", "pos,neg", *cols, "--out", tmp_path / "e1"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "e1" / "metrics.json").read_text())["eval"]["ev"]["accuracy"] == 1.0
    code, err = run(["eval", "--model", model_dir, "--labels", "good,bad", *cols, "--out", tmp_path / "e2"], capsys)
    assert code == 2 and "good, bad" in err and "neg, pos" in err and not (tmp_path / "e2").exists()
    # generic names (LABEL_0, LABEL_1): --labels gives the ids in order
    generic = _save(_always(_bert(tiny, 2), 0), tmp_path / "g", tiny)
    code, err = run(["eval", "--model", generic, "--labels", "pos,neg", *cols, "--out", tmp_path / "e3"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "e3" / "metrics.json").read_text())["eval"]["ev"]["accuracy"] == 1.0


def test_eval_of_a_builtin_task_maps_its_labels_by_name(tiny, tmp_path, capsys):
    model_dir = _save(_always(_bert(tiny, 2, ("Positive", "Negative")), 0), tmp_path / "m", tiny)
    data = write(tmp_path / "pos.tsv", [("Sentiment", "Text"), ("Positive", "a good film"),
                                         ("Positive", "a great plot")])
    code, err = run(["eval", "--model", model_dir, "--task", "sentiment", "--eval", f"pos={data}", "--out",
                     tmp_path / "e"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "e" / "metrics.json").read_text())["eval"]["pos"]["accuracy"] == 1.0


# ------------------------------------------------------------------ no random head outside training


def _encoder_only(tiny, directory):
    return _save(transformers.BertModel.from_pretrained(tiny), directory, tiny)


def _other_label_count(tiny, directory):
    d = shutil.copytree(tiny, directory)
    config = json.loads((d / "config.json").read_text())
    config["id2label"] = {str(i): f"LABEL_{i}" for i in range(3)}
    config["label2id"] = {f"LABEL_{i}": i for i in range(3)}
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def test_a_checkpoint_without_its_head_is_refused(tiny, tmp_path, capsys):
    data = write(tmp_path / "ev.tsv", [("text", "label"), ("a good film", "pos"), ("a bad film", "neg")])
    cols = ["--text-column", "text", "--label-column", "label", "--labels", "neg,pos", "--eval", f"ev={data}"]
    for name, make, words in (("enc", _encoder_only, "missing: classifier.bias, classifier.weight"),
                              ("three", _other_label_count, "classifier.weight (checkpoint [2, 32], model [3, 32])")):
        directory = make(tiny, tmp_path / name)
        code, err = run(["eval", "--model", directory, *cols, "--out", tmp_path / f"ev-{name}"], capsys)
        line = [x for x in err.splitlines() if x.startswith("cat-fast: error:")]
        assert code == 2 and len(line) == 1 and directory in line[0] and words in line[0], err
        assert not (tmp_path / f"ev-{name}").exists()
        with pytest.raises(ModelLoadError, match="no trained classification head"):
            load_classifier(directory, None)


def test_only_a_new_head_asked_for_is_drawn_and_said(tiny, tmp_path, capsys):
    encoder = _encoder_only(tiny, tmp_path / "enc")
    capsys.readouterr()
    model, _ = load_classifier(encoder, 2, new_head=True)
    assert f"cat-fast: the classification head of {encoder} is newly initialised (2 labels)" in capsys.readouterr().err
    load_classifier(tiny, 2, new_head=True)  # its own head: loaded, nothing said
    assert "newly" not in capsys.readouterr().err
    load_classifier(tiny, 3, new_head=True)
    assert "newly initialised (3 labels)" in capsys.readouterr().err
    with pytest.raises(ModelLoadError, match="of other shapes"):
        load_classifier(tiny, 3)
    with pytest.raises(ValueError, match="new_head"):
        load_classifier(tiny, 2, new_head="yes")


def test_train_from_an_encoder_says_the_head_is_new(tiny, tmp_path, capsys):
    encoder = _encoder_only(tiny, tmp_path / "enc")
    argv = ["train", "--task", "sentiment", "--method", "erm", "--per-class", 2, "--epochs", 1, "--max-length", 16,
            "--batch-size", 4, "--no-checkpoint"]
    code, err = run(argv + ["--model", encoder, "--out", tmp_path / "a"], capsys)
    assert code == 0, err
    assert "classification head of" in err and "newly initialised (2 labels)" in err


def test_train_keeps_a_checkpoint_head_only_for_the_same_label_order(tiny, tmp_path):
    swapped = _save(_bert(tiny, 2, ("Positive", "Negative")), tmp_path / "m", tiny)
    with pytest.raises(ModelLoadError, match=r"Positive, Negative.*Negative, Positive"):
        load_classifier(swapped, 2, label_names=("Negative", "Positive"), new_head=True)
    load_classifier(swapped, 2, label_names=("Positive", "Negative"), new_head=True)


# ------------------------------------------------------------------ saved masks


def _masked(model_dir, tmp_path, neurons, name="masked"):
    model, tokenizer = load_classifier(model_dir, None)
    masking.mask_neurons(model, neurons, 0.0)
    out = tmp_path / name
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def test_every_load_runs_a_masked_model_masked_or_refuses_it(nli_dir, tiny, tmp_path, capsys):
    neurons = [(1, "intermediate", 3), (2, "output", 5)]
    masked = _masked(nli_dir, tmp_path, neurons)
    model, tok = load_classifier(masked, None)
    want, _ = load_classifier(nli_dir, None)
    masking.mask_neurons(want, neurons, 0.0)
    batch = tok(["a man sleeps"], ["a person rests"], return_tensors="pt")
    torch.testing.assert_close(model.eval()(**batch).logits, want.eval()(**batch).logits)
    assert masking.masked_neurons(model)["neurons"] == [list(n) for n in neurons]
    with pytest.raises(ModelLoadError, match="a masked model"):
        load_classifier(masked, None, saved_mask="refuse")
    code, err = run(["train", "--task", "nli", "--method", "erm", "--model", masked, "--per-class", 2, "--epochs", 1,
                     "--out", tmp_path / "t"], capsys)
    assert code == 2 and "a masked model" in err and masked in err and not (tmp_path / "t").exists()


def test_mediation_runs_a_masked_model_masked(nli_dir, tmp_path, capsys):
    common = ["mediation", "--task", "nli", "--per-class", 2, "--max-length", 24, "--layers", 2, "--top-k", 3]
    code, err = run(common + ["--model", nli_dir, "--out", tmp_path / "plain"], capsys)
    assert code == 0, err
    plain = torch.load(tmp_path / "plain" / "nie.pt", weights_only=True)["effects"]
    top = [(2, r.split("\t")[2], int(r.split("\t")[3]))
           for r in (tmp_path / "plain" / "top_neurons.tsv").read_text().splitlines()[1:]]
    masked = _masked(nli_dir, tmp_path, top)
    code, err = run(common + ["--model", masked, "--out", tmp_path / "nie-masked"], capsys)
    assert code == 0, err
    effects = torch.load(tmp_path / "nie-masked" / "nie.pt", weights_only=True)["effects"]
    for layer, comp, index in top:
        assert abs(float(plain[f"{layer}.{comp}"][index])) > 1e-3
        assert abs(float(effects[f"{layer}.{comp}"][index])) < 1e-6, (comp, index)


def test_mask_refuses_a_masked_model(nli_dir, tmp_path, capsys):
    masked = _masked(nli_dir, tmp_path, [(1, "query", 0)])
    model, _ = load_classifier(masked, None)
    nie = _nie(model, tmp_path / "nie")
    code, err = run(["mask", "--model", masked, "--nie", nie, "--out", tmp_path / "m2"], capsys)
    assert code == 2 and "a masked model" in err and not (tmp_path / "m2").exists()


def test_unlearn_runs_a_masked_model_masked_and_keeps_the_mask(nli_dir, tmp_path, capsys, monkeypatch):
    from cat_fast import models
    from cat_fast.analysis import unlearning
    from cat_fast.layers import interventions

    masked = _masked(nli_dir, tmp_path, [(1, "query", 0)])
    model, _ = load_classifier(masked, None)
    nie = _nie(model, tmp_path / "nie", top_k=2)
    orig = "cad:nli/train/original"  # the shipped NLI originals, by name: pytest may run from any directory
    code, err = run(["bias", "fit", "--kind", "overlap", "--task", "nli", "--train", orig, "--out", tmp_path / "b"],
                    capsys)
    assert code == 0, err
    seen = []
    real = unlearning.unlearn

    def spy(model, *a, **k):  # the mask in effect while unlearning, not only recorded in the config
        seen.append(sorted(interventions.active(models.structure(model).layer_modules[0]) or ()))
        return real(model, *a, **k)

    monkeypatch.setattr(unlearning, "unlearn", spy)
    code, err = run(["unlearn", "--model", masked, "--nie", nie, "--task", "nli", "--train", orig, "--bias",
                     tmp_path / "b", "--examples", "all", "--epochs", 1, "--max-length", 24, "--batch-size", 256,
                     "--out", tmp_path / "u"], capsys)
    assert code == 0, err
    assert seen == [["query"]]
    saved = json.loads((tmp_path / "u" / "config.json").read_text())[masking.CONFIG_KEY]
    assert saved["neurons"] == [[1, "query", 0]]


# ------------------------------------------------------------------ the nie file against the model


def _nie(model, directory, top_k=3, values=None):
    """A nie.pt for `model` (every component of layer 1; effects `values` or the neuron index / 1000)."""
    from cat_fast import models
    from cat_fast.analysis import nie_file
    from cat_fast.analysis.mediation import NeuronEffects

    effects = {}
    for comp in models.COMPONENTS:
        width = masking.component_width(model, 1, comp)
        effects[(1, comp)] = torch.arange(width, dtype=torch.float32) / 1000 if values is None else values(width)
    os.makedirs(directory, exist_ok=True)
    nie_file.save(os.path.join(directory, nie_file.NIE_FILE), NeuronEffects(effects), model, {"top_k": top_k})
    return str(directory)


def test_mask_and_unlearn_refuse_the_nie_of_another_model(nli_dir, tiny, tmp_path, capsys):
    big = _save(_bert(tiny, 3, NLI, layers=3, hidden=48), tmp_path / "big", tiny)
    twin = _save(_bert(tiny, 3, NLI, seed=1, init=0.3), tmp_path / "twin", tiny)
    model, _ = load_classifier(nli_dir, None)
    nie = _nie(model, tmp_path / "nie")
    code, err = run(["mask", "--model", big, "--nie", nie, "--out", tmp_path / "m1"], capsys)
    assert code == 2 and "2 layers" in err and "3 layers" in err and "query 32" in err and "query 48" in err, err
    code, err = run(["unlearn", "--model", big, "--nie", nie, "--task", "nli", "--bias", tmp_path / "nobias",
                     "--out", tmp_path / "u1"], capsys)
    assert code == 2 and "3 layers" in err, err
    code, err = run(["mask", "--model", twin, "--nie", nie, "--out", tmp_path / "m2"], capsys)
    assert code == 2 and "another model of the same shape" in err, err
    copy = shutil.copytree(nli_dir, tmp_path / "copy")  # the same weights elsewhere: accepted
    code, err = run(["mask", "--model", copy, "--nie", nie, "--top-k", 2, "--out", tmp_path / "m3"], capsys)
    assert code == 0, err
    assert not any((tmp_path / n).exists() for n in ("m1", "m2", "u1"))


@pytest.mark.parametrize("values, words", [
    (lambda w: torch.full((w,), float("nan")), "non-finite"),
    (lambda w: torch.empty(0), "no neuron effects"),
])
def test_mask_refuses_a_nie_file_with_no_usable_effects(nli_dir, tmp_path, capsys, values, words):
    model, _ = load_classifier(nli_dir, None)
    nie = _nie(model, tmp_path / "nie", values=values)
    code, err = run(["mask", "--model", nli_dir, "--nie", nie, "--out", tmp_path / "m"], capsys)
    assert code == 2 and words in err and "nie.pt" in err and not (tmp_path / "m").exists(), err


def test_mask_numbers_are_checked(nli_dir, tmp_path, capsys):
    model, _ = load_classifier(nli_dir, None)
    nie = _nie(model, tmp_path / "nie")
    code, err = run(["mask", "--model", nli_dir, "--nie", nie, "--top-k", 100000, "--out", tmp_path / "m"], capsys)
    assert code == 2 and "--top-k 100000 is larger than the 224 neurons in --nie" in err, err
    for factor in ("nan", "inf", "-1", "2"):
        code, err = run(["mask", "--model", nli_dir, "--nie", nie, "--factor", factor, "--out", tmp_path / "m"],
                        capsys)
        assert code == 2 and "--factor must be a finite number in [0, 1]" in err and "nie" not in err, err
    assert not (tmp_path / "m").exists()


def test_mediation_and_unlearn_numbers_are_checked(nli_dir, tmp_path, capsys):
    common = ["mediation", "--model", nli_dir, "--task", "nli", "--layers", 2]
    model, _ = load_classifier(nli_dir, None)
    nie = _nie(model, tmp_path / "nie")
    code, err = run(common + ["--per-class", 1000, "--out", tmp_path / "a"], capsys)
    assert code == 2 and "--per-class 1000" in err and "of class" in err, err
    code, err = run(common + ["--per-class", 2, "--top-k", 100000, "--max-length", 16, "--out", tmp_path / "b"],
                    capsys)
    assert code == 2 and "--top-k 100000 is larger than the" in err, err
    for length in (1000, 1):
        code, err = run(common + ["--per-class", 2, "--max-length", length, "--out", tmp_path / "c"], capsys)
        assert code == 2 and "--max-length must be at least 5" in err and f"got {length}" in err, err
        code, err = run(["unlearn", "--model", nli_dir, "--nie", nie, "--task", "nli", "--bias", tmp_path / "nobias",
                         "--max-length", length, "--out", tmp_path / "u"], capsys)
        assert code == 2 and "--max-length must be at least 5" in err, err
    code, err = run(["unlearn", "--model", nli_dir, "--nie", nie, "--task", "nli", "--bias", tmp_path / "nobias",
                     "--top-k", 100000, "--out", tmp_path / "u"], capsys)
    assert code == 2 and "--top-k 100000 is larger than the 224 neurons" in err, err
    assert not any((tmp_path / n).exists() for n in ("a", "b", "c", "u"))
