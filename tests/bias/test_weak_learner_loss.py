"""The weak learner's generalized cross-entropy: the loss against its formula, its gradient against cross-entropy's
weighted by p_y^q, the options refused with their reason, and `bias fit --weak-loss gce` on a tiny BERT recorded
in bias_meta.json."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from cat_fast.bias.weak_learner import WeakLearner, WeakLearnerError, gce_loss
from tests.cli.conftest import run, tiny, write_csv  # noqa: F401  (tiny: a fixture)


def test_gce_is_the_plain_formula():
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.0, 0.0, 0.0], [-3.0, 1.0, 4.0]])
    labels = torch.tensor([0, 2, 0])
    for q in (0.3, 0.7, 1.0):
        rows = []
        for row, y in zip(logits.tolist(), labels.tolist()):
            p = math.exp(row[y]) / sum(math.exp(v) for v in row)
            rows.append((1 - p ** q) / q)
        assert gce_loss(logits, labels, q).item() == pytest.approx(sum(rows) / len(rows), rel=1e-6)
    p_y = torch.softmax(logits, -1)[torch.arange(3), labels]
    assert gce_loss(logits, labels, 1.0).item() == pytest.approx(float((1 - p_y).mean()), rel=1e-6)
    # q -> 0: cross-entropy
    assert gce_loss(logits, labels, 1e-4).item() == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-3)


def test_gce_gradient_is_cross_entropy_weighted_by_p_y_to_the_q():
    torch.manual_seed(0)
    logits = torch.randn(5, 2, requires_grad=True)
    labels = torch.tensor([0, 1, 1, 0, 1])
    q = 0.7
    (g_gce,) = torch.autograd.grad(gce_loss(logits, labels, q), logits)
    (g_ce,) = torch.autograd.grad(F.cross_entropy(logits, labels, reduction="none").mean(), logits)
    p_y = torch.softmax(logits.detach(), -1)[torch.arange(5), labels]
    torch.testing.assert_close(g_gce, g_ce * p_y[:, None] ** q, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("options, option", [({"loss": "mse"}, "loss"), ({"loss": "gce", "gce_q": 0}, "gce_q"),
                                             ({"loss": "gce", "gce_q": 1.5}, "gce_q"), ({"gce_q": True}, "gce_q"),
                                             ({"gce_q": float("nan")}, "gce_q")])
def test_bad_loss_options_are_refused(options, option):
    with pytest.raises(WeakLearnerError) as error:
        WeakLearner(**options)
    assert error.value.option == option


def rows(n=16):
    words = ("good", "great", "fine", "bad", "awful", "poor", "ok", "plain", "movie", "film")
    return [{"text": " ".join(words[(i + k) % len(words)] for k in range(4)), "label": ("pos", "neg")[i % 2]}
            for i in range(n)]


def fit_argv(data, out, *extra):
    return ["bias", "fit", "--train", data, "--text-column", "text", "--label-column", "label", "--out", out, *extra]


def weak_argv(tiny_dir):
    return ["--kind", "weak-learner", "--model", tiny_dir, "--subset", 8, "--epochs", 2, "--layers", 1,
            "--max-length", 16, "--batch-size", 4, "--folds", 2, "--calibrate", "none", "--device", "cpu"]


def test_gce_is_the_default_recorded_and_trains_otherwise_than_ce(tiny, tmp_path, capsys):  # noqa: F811
    data = write_csv(tmp_path / "t.csv", rows())
    outs = {}
    for name, extra in (("ce", ["--weak-loss", "ce"]), ("gce", ["--gce-q", 0.5]), ("default", [])):
        outs[name] = tmp_path / name
        code, err = run(fit_argv(data, outs[name], *weak_argv(tiny), *extra), capsys)
        assert code == 0, err
    meta = {k: json.loads((v / "bias_meta.json").read_text()) for k, v in outs.items()}
    assert meta["gce"]["options"]["loss"] == "gce" and meta["gce"]["options"]["gce_q"] == 0.5
    assert meta["gce"]["model"]["loss"] == "gce" and meta["gce"]["model"]["gce_q"] == 0.5
    assert meta["ce"]["options"]["loss"] == "ce" and "gce_q" not in meta["ce"]["options"]
    assert meta["ce"]["model"]["gce_q"] is None
    assert meta["default"]["options"]["loss"] == "gce" and meta["default"]["options"]["gce_q"] == 0.7
    lines = {k: [json.loads(s) for s in (v / "bias.jsonl").read_text().splitlines()[1:]] for k, v in outs.items()}
    assert lines["ce"] != lines["gce"]  # the loss is used: same seed, same rows, other predictions


@pytest.mark.parametrize("extra, words", [
    (["--weak-loss", "ce", "--gce-q", 0.5], ["--gce-q 0.5", "not ce", "expected --weak-loss gce"]),
    (["--weak-loss", "gce", "--gce-q", 0], ["argument --gce-q", "expected a number in (0, 1]"]),
    (["--weak-loss", "gce", "--gce-q", 2], ["argument --gce-q", "expected a number in (0, 1]"]),
    (["--weak-loss", "mae"], ["argument --weak-loss", "invalid choice"]),
])
def test_bad_gce_options_are_one_line(tiny, tmp_path, capsys, extra, words):  # noqa: F811
    data = write_csv(tmp_path / "t.csv", rows())
    out = tmp_path / "b"
    code, err = run(fit_argv(data, out, *weak_argv(tiny), *extra), capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("cat-fast: error: "), (code, err)
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not out.exists()


def test_gce_options_belong_to_the_weak_learner(tmp_path, capsys):
    data = write_csv(tmp_path / "t.csv", [dict(r, cue=str(i % 2)) for i, r in enumerate(rows())])
    code, err = run(fit_argv(data, tmp_path / "b", "--kind", "features", "--feature-columns", "cue", "--weak-loss",
                             "gce"), capsys)
    assert code == 2 and "--weak-loss is for --kind weak-learner, not features" in err, err
