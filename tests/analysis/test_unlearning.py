"""Gradient unlearning (cat_fast.analysis.unlearning): only the rows producing the selected neurons move, against
the gradient; every other parameter stays bit-identical."""
import pytest
import torch

from cat_fast.analysis import unlearning
from tests.conftest import tiny_batch, tiny_model

NEURONS = [(1, "intermediate", 5), (2, "query", 3), (3, "output", 31), (2, "attention_output", 7)]


def _batches(arch="bert", n=3, advantaged_bias=True):
    out = []
    for seed in range(n):
        b = tiny_batch(arch, batch=6, seed=seed)
        bias = torch.nn.functional.one_hot(b["labels"], 3).double().clamp_min(1e-3).log()  # right on every row
        out.append({k: v for k, v in b.items() if k in ("input_ids", "attention_mask", "token_type_ids", "labels")}
                   | {"bias": bias})
    return out


@pytest.mark.parametrize("arch", ["bert", "distilbert"])
def test_only_the_producing_rows_move(arch):
    model = tiny_model(arch)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    stats = unlearning.unlearn(model, NEURONS, _batches(arch), lr=1e-2, epochs=2, advantaged=False)
    assert stats["steps"] == 6 and stats["rows_used"] == 36
    targets = {id(p): idx for p, idx in unlearning.producing_parameters(model, NEURONS)}
    moved_any = False
    for name, p in model.named_parameters():
        if id(p) in targets:
            idx = targets[id(p)]
            rest = torch.ones(p.shape[0], dtype=torch.bool)
            rest[idx] = False
            assert torch.equal(p.detach()[rest], before[name][rest]), name  # bit-identical outside the rows
            moved_any |= not torch.equal(p.detach()[idx], before[name][idx])
        else:
            assert torch.equal(p.detach(), before[name]), name
    assert moved_any
    assert all(p.requires_grad for p in model.parameters())


def test_step_ascends_the_loss():
    """One small step increases the cross-entropy of the batch (the gradient is reversed)."""
    model = tiny_model("bert", dtype=torch.float64)
    batch = _batches(n=1)[0]
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "bias")}

    def loss():
        model.eval()
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model(**inputs).logits, batch["labels"])

    base = loss()
    model.config.hidden_dropout_prob = 0.0
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    unlearning.unlearn(model, NEURONS, [batch], lr=1e-3, weight_decay=0.0, advantaged=False)
    assert loss() > base


def test_advantaged_rows_only():
    """With advantaged=True only rows the bias gets right and the model gets wrong count; a bias that is wrong
    everywhere leaves nothing to train on (no step, nothing moves)."""
    model = tiny_model("bert")
    batches = _batches()
    for b in batches:
        b["bias"] = torch.nn.functional.one_hot((b["labels"] + 1) % 3, 3).double().clamp_min(1e-3).log()
    before = [p.detach().clone() for p in model.parameters()]
    stats = unlearning.unlearn(model, NEURONS, batches, lr=1e-2)
    assert stats["steps"] == 0 and stats["rows_used"] == 0
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    stats = unlearning.unlearn(model, NEURONS, _batches(), lr=1e-2)
    assert 0 < stats["rows_used"] < 18


def test_advantaged_set_is_fixed_before_the_first_step():
    """The advantaged rows are chosen once (eval mode): a large ascent step that makes the model wrong everywhere
    does not add rows in later epochs, so every epoch trains on the same count."""
    model = tiny_model("bert").eval()
    batches = _batches()
    first = unlearning.advantaged_rows(model, batches)
    assert [m.dtype for m in first] == [torch.bool] * 3 and not model.training
    model.train()
    again = unlearning.advantaged_rows(model, batches)  # eval mode inside: dropout does not change the choice
    assert all(torch.equal(a, b) for a, b in zip(first, again)) and model.training
    n = int(sum(m.sum() for m in first))
    assert 0 < n < 18
    stats = unlearning.unlearn(model, NEURONS, batches, lr=1.0, epochs=3, weight_decay=0.0)
    assert stats["rows_used"] == 3 * n
    assert int(sum(m.sum() for m in unlearning.advantaged_rows(model, batches))) > n  # the ascent did its work


def test_candidate_class_keeps_that_gold_class_only():
    model = tiny_model("bert").eval()
    batches = _batches()
    every = unlearning.advantaged_rows(model, batches)
    for c in range(3):
        only = unlearning.advantaged_rows(model, batches, candidate_class=c)
        for b, a, o in zip(batches, every, only):
            assert torch.equal(o, a & (b["labels"] == c))
    assert sum(int(m.sum()) for c in range(3) for m in unlearning.advantaged_rows(model, batches, c)) == \
        sum(int(m.sum()) for m in every)
    with pytest.raises(ValueError, match="candidate_class: expected an index in \\[0, 3\\)"):
        unlearning.advantaged_rows(model, batches, candidate_class=3)
    with pytest.raises(ValueError, match="candidate_class: expected a class index"):
        unlearning.unlearn(model, NEURONS, batches, candidate_class="entailment")


@pytest.mark.parametrize("kwargs, words", [
    (dict(lr=-1.0), "lr: expected a finite number >= 0"),
    (dict(epochs=0), "epochs: expected an integer >= 1"),
    (dict(weight_decay=float("nan")), "weight_decay: expected a finite number"),
])
def test_bad_arguments(kwargs, words):
    with pytest.raises(ValueError) as caught:
        unlearning.unlearn(tiny_model("bert"), NEURONS, _batches(n=1), **kwargs)
    assert words in str(caught.value)


def test_missing_bias_is_a_clear_error():
    batches = [{k: v for k, v in b.items() if k != "bias"} for b in _batches(n=1)]
    with pytest.raises(ValueError, match="advantaged=True needs batch\\['bias'\\]"):
        unlearning.unlearn(tiny_model("bert"), NEURONS, batches)


def test_progress_is_shown_when_asked(capsys):
    unlearning.unlearn(tiny_model("bert"), NEURONS, _batches(n=2), lr=1e-3, epochs=2, advantaged=False, progress=True)
    err = capsys.readouterr().err
    assert "unlearning" in err and "/4 [" in err  # a bar over the 2 x 2 steps
    unlearning.unlearn(tiny_model("bert"), NEURONS, _batches(n=2), lr=1e-3, advantaged=False)
    assert "unlearning" not in capsys.readouterr().err
