"""cat-fast predict (per-example predictions as CSV or JSON Lines) and the confusion matrices of cat-fast eval, on the
tiny model with named labels."""
import csv
import json
import os
import shutil

import pytest
import torch

from cat_fast import cli

from .conftest import run

transformers = pytest.importorskip("transformers")

CAD_DEV = os.path.join(os.path.dirname(cli.__file__), os.pardir, "data", "cad", "sentiment", "orig", "dev.tsv")
TEXTS = ("a fine film with a great cast", "awful plot and poor acting", "ok", "the best movie of the year",
         "boring", "I did not like it at all, the actors were bad")


@pytest.fixture(scope="module")
def named(tiny, tmp_path_factory):
    """The tiny model with the labels Negative (id 0) and Positive (id 1)."""
    d = tmp_path_factory.mktemp("named")
    for f in os.listdir(tiny):
        shutil.copy(os.path.join(tiny, f), d / f)
    config = json.loads((d / "config.json").read_text())
    config["id2label"], config["label2id"] = {"0": "Negative", "1": "Positive"}, {"Negative": 0, "Positive": 1}
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _labelled(path):
    return _jsonl(path, [{"id": f"r{i}", "text": t, "label": ("Positive", "Negative")[i % 2]}
                         for i, t in enumerate(TEXTS)])


def _probs(model_dir, texts):
    """The reference: the model's softmax through transformers alone, one example at a time."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return torch.cat([model(**tok(t, return_tensors="pt", truncation=True, max_length=32)).logits.softmax(-1)
                          for t in texts])


def test_predict_writes_csv_with_ids_probabilities_and_gold(named, tmp_path, capsys):
    data = _labelled(tmp_path / "data.jsonl")
    out = tmp_path / "preds" / "p.csv"
    code, err = run(["predict", "--model", named, "--data", data, "--id-column", "id", "--max-length", 32,
                     "--eval-batch-size", 4, "--out", out], capsys)
    assert code == 0, err
    with open(out, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["id", "prediction", "prob_Negative", "prob_Positive", "gold"]
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(len(TEXTS))]
    assert [r["gold"] for r in rows] == [("Positive", "Negative")[i % 2] for i in range(len(TEXTS))]
    probs = torch.tensor([[float(r["prob_Negative"]), float(r["prob_Positive"])] for r in rows])
    torch.testing.assert_close(probs, _probs(named, TEXTS), rtol=0, atol=1e-5)
    assert [r["prediction"] for r in rows] == [("Negative", "Positive")[int(i)] for i in probs.argmax(-1)]
    assert sorted(os.listdir(out.parent)) == ["p.csv"]  # no temporary file left beside it


def test_predict_jsonl_without_a_label_column(named, tmp_path, capsys):
    data = _jsonl(tmp_path / "unlabelled.jsonl", [{"text": t} for t in TEXTS])
    out = tmp_path / "p.jsonl"
    code, err = run(["predict", "--model", named, "--data", data, "--max-length", 32, "--out", out], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [str(i) for i in range(len(TEXTS))]
    assert all(set(r) == {"id", "prediction", "probs"} and list(r["probs"]) == ["Negative", "Positive"] for r in rows)
    probs = torch.tensor([[r["probs"]["Negative"], r["probs"]["Positive"]] for r in rows])
    torch.testing.assert_close(probs, _probs(named, TEXTS), rtol=0, atol=1e-5)


def test_predict_with_a_task_preset_maps_labels_by_name(named, tmp_path, capsys):
    out = tmp_path / "cad.jsonl"
    code, err = run(["predict", "--model", named, "--task", "sentiment", "--data", CAD_DEV, "--max-length", 32,
                     "--out", out], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    with open(CAD_DEV, encoding="utf-8") as f:
        gold = [line.split("\t")[0] for line in f.read().splitlines()[1:] if line.strip()]
    assert [r["gold"] for r in rows] == gold and set(gold) == {"Negative", "Positive"}


def test_predict_refuses_a_bad_or_existing_out(named, tmp_path, capsys):
    data = _labelled(tmp_path / "data.jsonl")
    args = ["predict", "--model", named, "--data", data, "--max-length", 32, "--out"]
    code, err = run(args + [tmp_path / "p.txt"], capsys)
    assert code == 2 and "--out" in err and ".csv" in err and ".jsonl" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "p.txt").exists()
    existing = tmp_path / "p.csv"
    existing.write_text("keep\n")
    code, err = run(args + [existing], capsys)
    assert code == 2 and "--overwrite" in err and existing.read_text() == "keep\n"
    code, err = run(args + [existing, "--overwrite"], capsys)
    assert code == 0, err
    assert existing.read_text().startswith("id,prediction,")
    code, err = run(args + [data, "--overwrite"], capsys)  # the input itself is never replaced
    assert code == 2 and "--out" in err and "--data" in err
    code, err = run(["predict", "--model", named, "--data", data, "--label-column", "gold", "--out",
                     tmp_path / "q.csv"], capsys)
    assert code == 2 and "gold" in err and not (tmp_path / "q.csv").exists()
    assert sorted(os.listdir(tmp_path)) == ["data.jsonl", "p.csv"]


def _stdout_eval(argv, capsys):
    capsys.readouterr()
    assert cli.main([str(a) for a in argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_eval_writes_a_confusion_matrix_per_set(named, tmp_path, capsys):
    data = _labelled(tmp_path / "data.jsonl")
    printed = _stdout_eval(["eval", "--model", named, "--eval", f"mine={data}", "--max-length", 32], capsys)
    mine = printed["eval"]["mine"]
    assert set(mine) == {"accuracy", "n"}  # the scores as `cat-fast train` writes them; the matrix beside them
    confusion = printed["confusion"]["mine"]
    assert confusion["labels"] == ["Negative", "Positive"]
    m = torch.tensor(confusion["matrix"])
    assert m.shape == (2, 2) and int(m.sum()) == mine["n"] == len(TEXTS)
    assert m.sum(1).tolist() == [3, 3]  # rows: gold (three of each)
    probs = _probs(named, TEXTS)
    assert m.sum(0).tolist() == torch.bincount(probs.argmax(-1), minlength=2).tolist()  # columns: predicted
    assert abs(int(m.trace()) / len(TEXTS) - mine["accuracy"]) < 1e-9

    out = tmp_path / "ev"
    code, err = run(["eval", "--model", named, "--task", "sentiment", "--eval", f"cad={CAD_DEV}", "--max-length", 32,
                     "--out", out], capsys)
    assert code == 0, err
    metrics = json.loads((out / "metrics.json").read_text())
    scored = metrics["eval"]
    assert set(scored) == set(metrics["confusion"]) == {"dev", "dev_orig", "dev_edit", "cad"}
    for name, s in scored.items():
        c = metrics["confusion"][name]
        assert c["labels"] == ["Negative", "Positive"], name
        m = torch.tensor(c["matrix"])
        assert int(m.sum()) == s["n"] and abs(int(m.trace()) / s["n"] - s["accuracy"]) < 1e-9, name


def test_eval_confusion_of_hans_is_entailment_against_non_entailment(tiny, tmp_path, capsys):
    d = tmp_path / "nli"
    d.mkdir()
    for f in os.listdir(tiny):
        if not f.startswith(("config", "model")):
            shutil.copy(os.path.join(tiny, f), d / f)
    names = ("entailment", "neutral", "contradiction")
    config = transformers.AutoConfig.from_pretrained(tiny, num_labels=3, id2label=dict(enumerate(names)),
                                                     label2id={n: i for i, n in enumerate(names)})
    torch.manual_seed(0)
    transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(d)
    printed = _stdout_eval(["eval", "--model", d, "--task", "nli", "--eval", "hans", "--max-length", 32], capsys)
    assert printed["confusion"]["dev"]["labels"] == list(names)
    hans = printed["confusion"]["hans"]
    m = torch.tensor(hans["matrix"])
    assert hans["labels"] == ["entailment", "non-entailment"] and m.sum(1).tolist() == [1500, 1500]
    assert abs(int(m.trace()) / 3000 - printed["eval"]["hans"]["accuracy"]) < 1e-9
    assert not any(k.startswith("hans/") for k in printed["confusion"])
