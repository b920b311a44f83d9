"""cat-fast mediation on single texts with any treatment rule, then mask --select-k; a bias-model loss followed by
masking (bias fit, train --method poe, mediation, mask --select-k); every bad input refused with one line, exit 2
and nothing written."""
import json

import pytest

from .conftest import run, write

WORDS = ("good", "great", "fine", "bad", "awful", "poor", "plain", "movie", "film", "plot", "music", "story")
OWN = ["--text-column", "text", "--label-column", "label"]


def rows(n, offset=0, anti=False):
    """Single texts; the cue word 'amazing' (column cue=yes) mostly on positive rows (the reverse with `anti`)."""
    out = [("text", "label", "cue")]
    for i in range(offset, offset + n):
        label = ("pos", "neg")[i % 2]
        cue = (label == "pos") != (i % 5 == 0)
        cue = cue != anti
        text = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(4))
        out.append((("amazing " if cue else "") + text, label, "yes" if cue else "no"))
    return out


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory):
    """Data files, a model trained on them, its bias-model fit and a mediation output (--treatment-where)."""
    d = tmp_path_factory.mktemp("any_treatment")
    files = {"train": write(d / "train.tsv", rows(32)), "dev": write(d / "dev.tsv", rows(24, offset=100)),
             "anti": write(d / "anti.tsv", rows(12, offset=200, anti=True))}
    model = d / "erm"
    code, err = run(["train", "--method", "erm", "--model", tiny, "--train", files["train"], *OWN, "--epochs", 1,
                     "--max-length", 16, "--batch-size", 8, "--out", model])
    assert code == 0, err
    bias = d / "bias"
    code, err = run(["bias", "fit", "--kind", "features", "--feature-columns", "cue", "--train", files["train"], *OWN,
                     "--out", bias])
    assert code == 0, err
    nie = d / "nie"
    code, err = run(["mediation", "--model", model, "--samples", files["dev"], *OWN, "--treatment-where", "cue=yes",
                     "--target-class", "pos", "--per-class", 3, "--layers", 2, "--max-length", 16, "--top-k", 5,
                     "--out", nie])
    assert code == 0, err
    return {"dir": d, "model": model, "bias": bias, "nie": nie, **files}


def test_where_then_select_k(setup, tmp_path, capsys):
    meta = json.loads((setup["nie"] / "mediation.json").read_text())
    assert meta["treatment_rule"] == {"rule": "where", "column": "cue", "value": "yes"}
    assert meta["samples"] == 6 and meta["treatment"] % 2 == 0 and meta["treatment"] > 0
    assert meta["treatment_rows"] + meta["control_rows"] == 24 and meta["target_class"] == 1  # pos: id 1
    out = tmp_path / "masked"
    code, err = run(["mask", "--model", setup["model"], "--nie", setup["nie"], "--select-k", "--k-grid", "1,4,16",
                     "--select-dev", setup["dev"], "--k-rule", "max-drop:100", "--out", out], capsys)
    assert code == 0, err
    sel = json.loads((out / "k_selection.json").read_text())
    assert sel["grid"] == [0, 1, 4, 16] and [p["k"] for p in sel["curve"]] == [0, 1, 4, 16]
    assert sel["chosen_k"] == 16 and sel["rule"] == "max-drop:100.0"  # a drop of 100 points always passes
    assert len(json.loads((out / "config.json").read_text())["cat_fast_neuron_mask"]["neurons"]) == 16
    assert json.loads((out / "mask.json").read_text())["top_k"] == 16
    code, err = run(["eval", "--model", setup["model"], "--eval", f"dev={setup['dev']}", *OWN, "--out",
                     tmp_path / "ev"], capsys)
    assert code == 0, err
    plain = json.loads((tmp_path / "ev" / "metrics.json").read_text())["eval"]["dev"]["accuracy"]
    assert sel["curve"][0]["accuracy"]["select-dev"] == pytest.approx(plain)  # k = 0: the unmasked model

    out = tmp_path / "refined"  # no drop allowed: the gap above the grid's pick is bisected (3 times by default)
    code, err = run(["mask", "--model", setup["model"], "--nie", setup["nie"], "--select-k", "--k-grid", "1,4,16",
                     "--select-dev", setup["dev"], "--k-rule", "max-drop:0", "--out", out], capsys)
    assert code == 0, err
    sel = json.loads((out / "k_selection.json").read_text())
    grid_curve = [p for p in sel["curve"] if not p.get("refined")]
    assert sel["refine"] == 3 and [p["k"] for p in grid_curve] == [0, 1, 4, 16]
    from cat_fast.analysis import k_selection as K
    pick = K.choose_k(grid_curve, K.Rule("max-drop", 0.0), "select-dev")
    added = [p["k"] for p in sel["curve"] if p.get("refined")]
    if pick < 16:
        following = [0, 1, 4, 16][[0, 1, 4, 16].index(pick) + 1]
        assert all(pick < k < following for k in added) and len(added) <= 3 and (added or following - pick < 2)
    else:
        assert added == []
    assert sel["chosen_k"] == K.choose_k(sel["curve"], K.Rule("max-drop", 0.0), "select-dev") >= pick

    out = tmp_path / "best"
    code, err = run(["mask", "--model", setup["model"], "--nie", setup["nie"], "--select-k", "--k-grid", "2%,5,10",
                     "--k-rule", f"best-on:{setup['anti']}", "--out", out], capsys)
    assert code == 0, err
    sel = json.loads((out / "k_selection.json").read_text())
    best = max(p["accuracy"]["best-on"] for p in sel["curve"])
    assert sel["chosen_k"] == min(p["k"] for p in sel["curve"] if p["accuracy"]["best-on"] == best)
    assert set(sel["sets"]) == {"best-on"} and sel["sizes"] == {"best-on": 12}


def test_treatment_file_and_bias(setup, tmp_path, capsys):
    ids = tmp_path / "ids.txt"
    ids.write_text("id\n0\n1\n2\n3\n4\n5\n")
    code, err = run(["mediation", "--model", setup["model"], "--samples", setup["train"], *OWN, "--treatment", ids,
                     "--target-class", "neg", "--per-class", 2, "--layers", 1, "--method", "first-order",
                     "--max-length", 16, "--out", tmp_path / "file"], capsys)
    assert code == 0, err
    meta = json.loads((tmp_path / "file" / "mediation.json").read_text())
    assert meta["treatment_rows"] == 6 and meta["control_rows"] == 26 and meta["treatment"] == 6
    code, err = run(["mediation", "--model", setup["model"], "--samples", setup["train"], *OWN,
                     "--treatment-from-bias", setup["bias"], "--bias-confidence", 0.75, "--target-class", "pos",
                     "--per-class", 2, "--layers", 1, "--method", "first-order", "--max-length", 16, "--out",
                     tmp_path / "bias"], capsys)
    assert code == 0, err
    meta = json.loads((tmp_path / "bias" / "mediation.json").read_text())
    assert meta["treatment_rule"]["rule"] == "bias" and 0 < meta["treatment_rows"] < 32  # one cue value's rows
    code, err = run(["mediation", "--model", setup["model"], "--samples", setup["train"], *OWN,
                     "--treatment-from-bias", setup["bias"], "--bias-confidence", 0.5, "--target-class", "pos",
                     "--layers", 1, "--out", tmp_path / "all"], capsys)
    _refused(code, err, "holds every one of the 32 rows", tmp_path / "all")


def test_treatment_id_files(tmp_path):
    from cat_fast.cli.treatment_options import _read_ids

    (tmp_path / "a.txt").write_text("7\n\n3\n")
    (tmp_path / "b.txt").write_text("id\n7\n3\n")
    (tmp_path / "c.tsv").write_text("text\tid\nx\t7\ny\t3\n")
    (tmp_path / "d.jsonl").write_text('{"id": 7}\n{"id": "3"}\n')
    for name in ("a.txt", "b.txt", "c.tsv", "d.jsonl"):
        assert _read_ids(str(tmp_path / name)) == ["7", "3"], name
    (tmp_path / "e.tsv").write_text("text\tkey\nx\t7\n")
    with pytest.raises(Exception, match="--treatment .*e.tsv: .*expected ids one per line or a column 'id'"):
        _read_ids(str(tmp_path / "e.tsv"))


def test_builtin_samples_by_name(setup, tmp_path, capsys):
    ids = tmp_path / "ids.txt"
    ids.write_text("".join(f"{i}\n" for i in range(10)))
    out = tmp_path / "cad"
    code, err = run(["mediation", "--model", setup["model"], "--samples", "cad:sentiment/dev", "--treatment", ids,
                     "--target-class", "pos", "--per-class", 2, "--layers", 1, "--method", "first-order",
                     "--max-length", 16, "--out", out], capsys)
    assert code == 0, err
    meta = json.loads((out / "mediation.json").read_text())
    assert meta["treatment_rows"] == 10 and meta["control_rows"] == 480 and meta["samples"] == 4
    code, err = run(["mediation", "--model", setup["model"], "--samples", "cad:sentiment/dev", "--treatment-where",
                     "cue=yes", "--target-class", "pos", "--out", tmp_path / "w"], capsys)
    _refused(code, err, "--treatment-where cue=yes: filters on a column of your own --samples FILE", tmp_path / "w")


def test_poe_then_mask_select_k(setup, tiny, tmp_path, capsys):
    """The paper's combination from the CLI: a bias-model loss (poe), then mediation and mask --select-k."""
    poe = tmp_path / "poe"
    code, err = run(["train", "--method", "poe", "--bias", setup["bias"], "--model", tiny, "--train", setup["train"],
                     *OWN, "--epochs", 1, "--max-length", 16, "--batch-size", 8, "--out", poe],
                    capsys)
    assert code == 0, err
    nie = tmp_path / "poe-nie"
    code, err = run(["mediation", "--model", poe, "--samples", setup["dev"], *OWN, "--treatment-where", "cue=yes",
                     "--target-class", "pos", "--per-class", 3, "--layers", 2, "--max-length", 16, "--out", nie],
                    capsys)
    assert code == 0, err
    out = tmp_path / "poe-masked"
    code, err = run(["mask", "--model", poe, "--nie", nie, "--select-k", "--k-grid", "1,3", "--select-dev",
                     setup["dev"], "--k-rule", f"best-on:{setup['anti']}", "--out", out], capsys)
    assert code == 0, err
    sel = json.loads((out / "k_selection.json").read_text())
    assert set(sel["curve"][0]["accuracy"]) == {"select-dev", "best-on"} and sel["chosen_k"] in (0, 1, 3)
    code, err = run(["eval", "--model", out, "--eval", f"anti={setup['anti']}", *OWN, "--out", tmp_path / "ev"],
                    capsys)
    assert code == 0, err
    score = json.loads((tmp_path / "ev" / "metrics.json").read_text())["eval"]["anti"]["accuracy"]
    chosen = next(p for p in sel["curve"] if p["k"] == sel["chosen_k"])
    assert score == pytest.approx(chosen["accuracy"]["best-on"])  # the written model is the one scored


MEDIATION_BAD = [
    (["--treatment-where", "cue=maybe"], "--treatment-where cue=maybe: the treatment set"),
    (["--treatment-where", "nope=1"], "--treatment-where nope=1: *missing column(s) nope"),
    (["--treatment", "IDS:999"], "treatment id '999' is not an example id"),
    (["--treatment", "IDS:0,2,4"], "holds class pos only"),
    (["--treatment-from-bias", "BIAS"], "its rows differ from the training data's"),
    ([], "the samples are single texts: choose their treatment set with --treatment FILE"),
    (["--treatment-where", "cue=yes", "--target-class", "maybe"], "target_class: 'maybe' is not a label of the model"),
    (["--treatment-where", "cue=yes", "--top-k", 99999], "--top-k 99999 is larger than the"),
    (["--treatment-where", "cue=yes", "--treatment", "IDS:0"], "--treatment and --treatment-where: expected one"),
    (["--treatment-where", "cue=yes", "--per-class", 50], "--per-class 50: "),
]


@pytest.mark.parametrize("extra, message", MEDIATION_BAD, ids=[m for _, m in MEDIATION_BAD])
def test_mediation_bad_input(setup, tmp_path, capsys, extra, message):
    argv = []
    for a in extra:
        if isinstance(a, str) and a.startswith("IDS:"):
            path = tmp_path / "ids.txt"
            path.write_text("\n".join(a[4:].split(",")) + "\n")
            a = path
        argv.append(setup["bias"] if a == "BIAS" else a)  # the bias was fitted on train, the samples are dev
    if "--target-class" not in extra:
        argv += ["--target-class", "pos"]
    out = tmp_path / "out"
    code, err = run(["mediation", "--model", setup["model"], "--samples", setup["dev"], *OWN, "--per-class", 3,
                     "--layers", 2, "--max-length", 16, *argv, "--out", out], capsys)
    _refused(code, err, message, out)


MASK_BAD = [
    (["--top-k", 99999], "--top-k 99999 is larger than the"),
    (["--select-k", "--k-grid", "99999", "--select-dev", "DEV"], "--k-grid: k grid item '99999': 99999 is larger"),
    (["--select-k"], "--k-rule max-drop:3.0: needs --select-dev FILE"),
    (["--k-grid", "1,2"], "--k-grid needs --select-k"),
    (["--k-refine", "2"], "--k-refine needs --select-k"),
    (["--select-k", "--top-k", 3, "--select-dev", "DEV"], "--top-k and --select-k: expected one"),
    (["--select-k", "--k-rule", "top:3", "--select-dev", "DEV"], "--k-rule: k rule 'top:3'"),
]


@pytest.mark.parametrize("extra, message", MASK_BAD, ids=[m for _, m in MASK_BAD])
def test_mask_bad_input(setup, tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    argv = [setup["dev"] if a == "DEV" else a for a in extra]
    code, err = run(["mask", "--model", setup["model"], "--nie", setup["nie"], *argv, "--out", out], capsys)
    _refused(code, err, message, out)


def _refused(code, err, message, out):
    errors = [line for line in err.splitlines() if line.startswith("cat-fast: error:")]
    assert code == 2 and len(errors) == 1 and all(part in errors[0] for part in message.split(" *")), err
    assert not out.exists()
