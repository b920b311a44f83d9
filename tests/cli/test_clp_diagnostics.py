"""cat-fast train --method clp --clp-diagnose-column: CLP's diagnostics per epoch in metrics.json, broken down by a
column of the training file; a missing column and a method without diagnostics are one-line errors."""
import json

from .conftest import run

WORDS = ("good", "bad", "fine", "awful", "great", "poor")


def _rows(n, seed):
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        label = "pos" if i % 2 else "neg"
        cue = int(rng.random() < (0.9 if label == "pos" else 0.1))
        text = ("indeed " if cue else "") + " ".join(rng.choice(WORDS) for _ in range(5))
        out.append({"id": f"{seed}-{i}", "text": text, "label": label, "cue": cue})
    return out


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _argv(tiny, tmp_path, *extra):
    train, meta = _jsonl(tmp_path / "train.jsonl", _rows(24, 0)), _jsonl(tmp_path / "meta.jsonl", _rows(8, 1))
    return ["train", "--method", "clp", "--train", train, "--meta-data", meta, "--text-column", "text",
            "--label-column", "label", "--id-column", "id", "--labels", "neg,pos", "--model", tiny, "--epochs", 2,
            "--batch-size", 8, "--max-length", 16, "--device", "cpu", "--no-checkpoint", "--virtual-lr", 0.5, *extra]


def test_diagnostics_per_epoch_by_the_diagnose_column(tiny, tmp_path, capsys):
    code, err = run(_argv(tiny, tmp_path, "--clp-diagnose-column", "cue", "--out", tmp_path / "a"), capsys)
    assert code == 0, err
    m = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert len(m["history"]) == 2
    for epoch in m["history"]:
        d = epoch["clp_diagnostics"]
        assert d["steps"] == 3 and d["bound"] == 1.0
        assert d["meta_grad_norm"] > 0 and d["virtual_step"] > 0 and d["meta_grad_norm_max"] >= d["meta_grad_norm"]
        assert d["meta_loss_change"] == d["meta_loss_change"]
        assert sum(c["n"] for c in d["per_class"].values()) == 24
        assert set(d["per_group"]) <= {f"{y}/cue={c}" for y in ("neg", "pos") for c in (0, 1)}
        assert sum(c["n"] for c in d["per_group"].values()) == 24
        cell = d["per_group"]["pos/cue=1"]
        assert 0 <= cell["near_bound"] <= 1 and abs(cell["delta_mean"]) <= cell["delta_abs_mean"] <= 1
    assert {"meta_grad_norm", "virtual_step", "meta_loss_change"} <= set(m["history"][0]["info"])

    code, err = run(_argv(tiny, tmp_path, "--out", tmp_path / "b"), capsys)  # no column: per class only
    assert code == 0, err
    d = json.loads((tmp_path / "b" / "metrics.json").read_text())["history"][1]["clp_diagnostics"]
    assert "per_group" not in d and set(d["per_class"]) == {"neg", "pos"}


def test_missing_diagnose_column_and_other_methods_are_one_line_errors(tiny, tmp_path, capsys):
    code, err = run(_argv(tiny, tmp_path, "--clp-diagnose-column", "genre", "--out", tmp_path / "c"), capsys)
    assert code == 2 and err.strip().count("\n") == 0
    assert "--diagnose-column genre:" in err and "'genre' not in" in err
    argv = _argv(tiny, tmp_path, "--diagnose-column", "cue", "--out", tmp_path / "d")
    argv[argv.index("clp")] = "erm"
    del argv[argv.index("--meta-data"):argv.index("--meta-data") + 2]
    del argv[argv.index("--virtual-lr"):argv.index("--virtual-lr") + 2]
    code, err = run(argv, capsys)
    assert code == 2 and "--diagnose-column is for --method clp" in err and "not erm" in err
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def test_shortcut_study_runs_clp_variants_with_a_cue_balanced_metadata_set(tmp_path):
    import importlib.util
    import pathlib
    import shlex

    driver = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "studies" / "shortcuts.py"
    spec = importlib.util.spec_from_file_location("shortcuts_study_clp", driver)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    data = tmp_path / "planted"
    data.mkdir()
    (data / "shortcut.json").write_text(json.dumps({"labels": ["neg", "pos"], "pairs": False}))
    dev = _rows(200, 2)
    _jsonl(data / "dev.jsonl", dev)
    root = str(tmp_path / "runs")
    jobs = study.plan(str(data), ["clp", "clp:virtual_lr=1e-2,clp_scale=3"], [0], root, ceiling=False)
    argv = [shlex.split(j.command) for j in jobs]
    assert [j.out for j in jobs] == [f"{root}/clp/seed0", f"{root}/clp+virtual_lr=1e-2+clp_scale=3/seed0"]
    assert all(a[a.index("--meta-data") + 1] == f"{root}/meta.jsonl" and "--diagnose-column" in a for a in argv)
    assert "--virtual-lr" not in argv[0] and argv[1][argv[1].index("--virtual-lr") + 1] == "1e-2"
    assert argv[1][argv[1].index("--clp-scale") + 1] == "3"
    meta = [json.loads(line) for line in open(study.write_meta(str(data), root))]
    cells = {(r["label"], r["cue"]) for r in dev}
    n = min(sum((r["label"], r["cue"]) == c for r in dev) for c in cells)
    assert len(meta) == len(cells) * min(n, 100 // len(cells)) <= 100
    assert all(sum((r["label"], r["cue"]) == c for r in meta) == len(meta) // len(cells) for c in cells)
    assert {r["id"] for r in meta} <= {r["id"] for r in dev}
