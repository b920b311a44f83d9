"""cat-fast mediation / mask / eval on a masked directory, end to end on a tiny model trained on CAD NLI."""
import json

import torch

from .conftest import run


def _trained(tiny, tmp_path, capsys):
    out = tmp_path / "erm"
    code, err = run(["train", "--task", "nli", "--method", "erm", "--model", tiny, "--per-class", 4, "--epochs", 1,
                     "--max-length", 32, "--batch-size", 8, "--out", out], capsys)
    assert code == 0, err
    return out


def test_mediation_then_mask_then_eval(tiny, tmp_path, capsys):
    model = _trained(tiny, tmp_path, capsys)
    nie = tmp_path / "nie"
    code, err = run(["mediation", "--model", model, "--task", "nli", "--per-class", 3, "--max-length", 32,
                     "--layers", 2, "--top-k", 5, "--out", nie], capsys)
    assert code == 0, err
    meta = json.loads((nie / "mediation.json").read_text())
    assert meta["samples"] == 9 and meta["treatment"] >= 3 and meta["method"] == "exact"
    rows = (nie / "top_neurons.tsv").read_text().strip().splitlines()
    assert rows[0].split("\t") == ["rank", "layer", "component", "neuron", "nie"] and len(rows) == 6
    assert all(r.split("\t")[1] == "2" for r in rows[1:])
    saved = torch.load(nie / "nie.pt", weights_only=True)
    assert set(saved["effects"]) == {f"2.{c}" for c in ("query", "key", "value", "attention_output", "intermediate",
                                                         "output")}
    assert (nie / "top_neurons.png").stat().st_size > 0
    code, err = run(["mediation", "--model", model, "--task", "nli", "--per-class", 3, "--max-length", 32,
                     "--method", "first-order", "--out", tmp_path / "fo"], capsys)
    assert code == 0, err

    masked = tmp_path / "masked"
    code, err = run(["mask", "--model", model, "--nie", nie, "--rescale", "--out", masked], capsys)
    assert code == 0, err
    config = json.loads((masked / "config.json").read_text())
    assert len(config["cat_fast_neuron_mask"]["neurons"]) == 5 and config["cat_fast_neuron_mask"]["rescale"]
    top = {tuple(n) for n in config["cat_fast_neuron_mask"]["neurons"]}
    code, err = run(["mask", "--model", model, "--nie", nie, "--random-neurons", "--seed", 3, "--out",
                     tmp_path / "random"], capsys)
    assert code == 0, err
    drawn = json.loads((tmp_path / "random" / "config.json").read_text())["cat_fast_neuron_mask"]["neurons"]
    assert len(drawn) == 5 and {tuple(n) for n in drawn} != top
    assert json.loads((tmp_path / "random" / "mask.json").read_text())["neurons"] == "random"
    scores = {}
    for name, directory in (("plain", model), ("masked", masked)):
        code, err = run(["eval", "--model", directory, "--eval", "hans", "--out", tmp_path / f"eval-{name}"], capsys)
        assert code == 0, err
        scores[name] = json.loads((tmp_path / f"eval-{name}" / "metrics.json").read_text())["eval"]
    assert scores["plain"]["dev"]["n"] == scores["masked"]["dev"]["n"] == 1000  # built-in dev with --eval hans
    assert scores["plain"]["hans"]["n"] == scores["masked"]["hans"]["n"] == 3000


def test_mediation_errors(tiny, tmp_path, capsys):
    model = _trained(tiny, tmp_path, capsys)
    code, err = run(["mediation", "--model", model, "--task", "nli", "--layers", 9, "--out", tmp_path / "x"], capsys)
    assert code == 2 and "layers: expected integers in [1, 2]" in err
    code, err = run(["mediation", "--model", model, "--task", "nli", "--target-class", "maybe", "--out",
                     tmp_path / "y"], capsys)
    assert code == 2 and "target_class: 'maybe' is not a label of the model" in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    code, err = run(["mask", "--model", model, "--nie", tmp_path, "--out", tmp_path / "z"], capsys)
    assert code == 2 and "no nie.pt" in err


def test_unlearn_writes_a_model_that_differs_only_in_the_rows(tiny, tmp_path, capsys):
    import transformers

    from cat_fast.analysis import unlearning

    model = _trained(tiny, tmp_path, capsys)
    nie = tmp_path / "nie"
    code, err = run(["mediation", "--model", model, "--task", "nli", "--per-class", 2, "--max-length", 32,
                     "--method", "first-order", "--top-k", 4, "--out", nie], capsys)
    assert code == 0, err
    orig = "cad:nli/train/original"  # the shipped NLI originals, by name: pytest may run from any directory
    bias = tmp_path / "bias"
    code, err = run(["bias", "fit", "--kind", "overlap", "--task", "nli", "--train", orig, "--out", bias], capsys)
    assert code == 0, err
    out = tmp_path / "unlearned"
    code, err = run(["unlearn", "--model", model, "--nie", nie, "--task", "nli", "--train", orig, "--bias", bias,
                     "--epochs", 1, "--lr", 1e-3, "--max-length", 32, "--out", out], capsys)
    assert code == 0, err
    meta = json.loads((out / "unlearn.json").read_text())
    assert meta["steps"] > 0 and 0 < meta["advantaged_examples"] < 1666 and meta["examples"] == "advantaged"
    assert meta["rows_used"] == meta["examples_used"] == meta["advantaged_examples"]  # one epoch, the fixed set
    before = transformers.AutoModelForSequenceClassification.from_pretrained(model)
    after = transformers.AutoModelForSequenceClassification.from_pretrained(out)
    top = [tuple(r.split("\t")[1:4]) for r in (nie / "top_neurons.tsv").read_text().splitlines()[1:]]
    neurons = [(int(a), b, int(c)) for a, b, c in top]
    rows = {name: idx for name, p in before.named_parameters()
            for q, idx in unlearning.producing_parameters(before, neurons) if q is p}
    changed = False
    for (name, p), (_, q) in zip(before.named_parameters(), after.named_parameters()):
        if name in rows:
            rest = torch.ones(p.shape[0], dtype=torch.bool)
            rest[rows[name]] = False
            assert torch.equal(p[rest], q[rest]), name
            changed |= not torch.equal(p, q)
        else:
            assert torch.equal(p, q), name
    assert changed
    code, err = run(["unlearn", "--model", model, "--nie", nie, "--task", "nli", "--train", orig, "--out",
                     tmp_path / "u2"], capsys)
    assert code == 2 and "--bias" in err
    # the paper's controls: as many random examples; random neurons
    code, err = run(["unlearn", "--model", model, "--nie", nie, "--task", "nli", "--train", orig, "--bias", bias,
                     "--epochs", 1, "--lr", 1e-3, "--max-length", 32, "--examples", "random", "--random-neurons",
                     "--seed", 5, "--out", tmp_path / "u3"], capsys)
    assert code == 0, err
    control = json.loads((tmp_path / "u3" / "unlearn.json").read_text())
    assert control["examples_used"] == control["advantaged_examples"] == meta["advantaged_examples"]
    assert control["examples"] == "random" and control["neurons"] == "random"
    code, err = run(["unlearn", "--model", model, "--nie", nie, "--task", "nli", "--train", orig, "--bias", bias,
                     "--epochs", 1, "--lr", 1e-3, "--max-length", 32, "--candidate-class", "entailment", "--out",
                     tmp_path / "u4"], capsys)
    if code == 0:  # the released code's rule: gold entailment only, a subset of the advantaged examples
        assert 0 < json.loads((tmp_path / "u4" / "unlearn.json").read_text())["advantaged_examples"] < \
            meta["advantaged_examples"]
    else:
        assert code == 2 and "gold label entailment" in err
    code, err = run(["unlearn", "--model", model, "--nie", nie, "--task", "nli", "--train", orig, "--bias", bias,
                     "--candidate-class", "maybe", "--out", tmp_path / "u5"], capsys)
    assert code == 2 and "--candidate-class: expected one of the model's labels" in err
    assert not (tmp_path / "u5").exists()


def test_mediation_under_torchrun_equals_one_process(tiny, tmp_path, capsys):
    """`torchrun --nproc_per_node 2 -m cat_fast.cli mediation` (gloo on the CPU): the tables are split over the two
    ranks, rank 0 writes them, and they equal the one-process sweep's."""
    import os
    import subprocess
    import sys

    model = _trained(tiny, tmp_path, capsys)
    common = ["mediation", "--model", str(model), "--task", "nli", "--per-class", "2", "--max-length", "32",
              "--device", "cpu", "--top-k", "5"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank below: a reduction split over threads sums in another order
    try:
        code, err = run(common + ["--out", tmp_path / "one"], capsys)
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "cat_fast.cli"] + common + ["--out", str(tmp_path / "two")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = torch.load(tmp_path / "one" / "nie.pt", weights_only=True)
    two = torch.load(tmp_path / "two" / "nie.pt", weights_only=True)
    assert two["processes"] == 2 and one["processes"] == 1
    assert set(one["effects"]) == set(two["effects"]) and len(one["effects"]) == 12
    for key, value in one["effects"].items():
        torch.testing.assert_close(two["effects"][key], value, rtol=0, atol=0)
    assert (tmp_path / "two" / "top_neurons.tsv").read_text() == (tmp_path / "one" / "top_neurons.tsv").read_text()
