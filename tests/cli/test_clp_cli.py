"""cat-fast train --method clp: the built-in metadata draw (balanced, left out of the dev score), --meta-data, errors."""
import json

from .conftest import run, write


def test_clp_trains_with_the_builtin_metadata(tiny, tmp_path, capsys):
    out = tmp_path / "clp"
    code, err = run(["train", "--task", "nli", "--method", "clp", "--model", tiny, "--per-class", 4, "--epochs", 1,
                     "--max-length", 32, "--batch-size", 8, "--meta-per-class", 3, "--out", out], capsys)
    assert code == 0, err
    m = json.loads((out / "metrics.json").read_text())
    # 3 originals per class with their 4 edits each = 45 pairs, cut to the smallest class count x 3 classes
    assert m["config"]["meta_examples"] % 3 == 0 and 9 <= m["config"]["meta_examples"] <= 45
    assert m["eval"]["dev"]["n"] == m["config"]["dev_examples"] == 1000 - 45  # the drawn groups are left out
    info = m["history"][0]["info"]  # the epoch's means of the objective's info
    assert {"meta_loss", "delta_abs_mean"} <= set(info) and info["meta_loss"] == info["meta_loss"]


def test_clp_with_own_metadata_and_errors(tiny, tmp_path, capsys):
    meta = write(tmp_path / "meta.tsv", [("sentence1", "sentence2", "gold_label"),
                                         ("A man sleeps.", "A person sleeps.", "entailment"),
                                         ("A man sleeps.", "A man runs.", "contradiction"),
                                         ("A man sleeps.", "He is tired.", "neutral")])
    code, err = run(["train", "--task", "nli", "--method", "clp", "--model", tiny, "--per-class", 2, "--epochs", 1,
                     "--max-length", 32, "--batch-size", 6, "--meta-data", meta, "--out", tmp_path / "a"], capsys)
    assert code == 0, err
    m = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert m["config"]["meta_examples"] == 3 and m["eval"]["dev"]["n"] == 1000
    code, err = run(["train", "--task", "nli", "--method", "erm", "--model", tiny, "--per-class", 2, "--epochs", 1,
                     "--max-length", 32, "--meta-holdout", "--meta-per-class", 3, "--out", tmp_path / "h"], capsys)
    assert code == 0, err
    held = json.loads((tmp_path / "h" / "metrics.json").read_text())
    assert held["eval"]["dev"]["n"] == held["config"]["dev_examples"] == 1000 - 45  # the clp run's scoring set
    code, err = run(["train", "--task", "nli", "--method", "erm", "--model", tiny, "--per-class", 2, "--meta-data",
                     meta, "--out", tmp_path / "b"], capsys)
    assert code == 2 and "--meta-data is for --method clp" in err
    code, err = run(["train", "--task", "nli", "--method", "clp", "--model", tiny, "--per-class", 2, "--clp-scale",
                     0, "--out", tmp_path / "c"], capsys)
    assert code == 2 and "--clp-scale must be a finite number > 0" in err
    code, err = run(["train", "--task", "nli", "--method", "clp", "--model", tiny, "--per-class", 2, "--virtual-lr",
                     -1, "--out", tmp_path / "c"], capsys)
    assert code == 2 and "--virtual-lr must be a finite number > 0" in err
    from cat_fast import objectives
    from tests.conftest import tiny_model

    built = objectives.build("clp", tiny_model("bert"), options={"virtual_lr": 0.5, "clp_scale": 2.0},
                             meta_batches=[])
    assert built.virtual_lr == 0.5 and built.omega.scale == 2.0
    code, err = run(["train", "--task", "nli", "--method", "clp", "--model", tiny, "--per-class", 2,
                     "--meta-per-class", 1000, "--out", tmp_path / "d"], capsys)
    assert code == 2 and "--meta-per-class 1000" in err
    assert not any((tmp_path / n).exists() for n in "bcd")


def test_noisy_labels_and_long_tail_options(tiny, tmp_path, capsys):
    code, err = run(["train", "--task", "nli", "--method", "erm", "--model", tiny, "--per-class", 10, "--epochs", 1,
                     "--max-length", 32, "--batch-size", 16, "--label-noise", 0.4, "--long-tail", "neutral=0.1",
                     "--out", tmp_path / "a"], capsys)
    assert code == 0, err
    d = json.loads((tmp_path / "a" / "metrics.json").read_text())["data"]
    assert d["long_tail"] == {"label": "neutral", "fraction": 0.1, "removed": 45}  # 50 neutral (orig+edits) -> 5
    assert d["label_noise"]["flipped"] == round(0.4 * d["n_train"])
    code, err = run(["train", "--task", "nli", "--method", "erm", "--model", tiny, "--per-class", 2, "--long-tail",
                     "neutral", "--out", tmp_path / "b"], capsys)
    assert code == 2 and "--long-tail: expected LABEL=FRACTION" in err
    code, err = run(["train", "--task", "nli", "--method", "erm", "--model", tiny, "--per-class", 2, "--label-noise",
                     1.5, "--out", tmp_path / "c"], capsys)
    assert code == 2 and "--label-noise must be in [0, 1)" in err
