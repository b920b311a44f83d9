"""cat_fast.bias.OverlapBias on the real CAD NLI splits: fitted on train, better than the class prior on dev."""
import pytest
import torch

from cat_fast import data as D
from cat_fast.bias import FEATURE_NAMES, OverlapBias, overlap_features


@pytest.fixture(scope="module")
def cad():
    return D.load_builtin("nli", "train"), D.load_builtin("nli", "dev")


@pytest.fixture(scope="module")
def fitted(cad):
    return OverlapBias().fit(cad[0])


def accuracy(log_probs, d):
    return float((log_probs.argmax(1) == torch.tensor(d.labels)).double().mean())


def test_beats_the_class_prior_on_dev(cad, fitted):
    train, dev = cad
    b = fitted.log_probs(dev)
    assert b.shape == (len(dev), 3) and b.dtype == torch.float32
    torch.testing.assert_close(torch.logsumexp(b, 1), torch.zeros(len(dev)), rtol=0, atol=1e-5)
    prior = max(dev.class_counts().values()) / len(dev)  # always predicting the largest class
    acc = accuracy(b, dev)
    print(f"\nOverlapBias on CAD NLI dev: accuracy {acc:.4f}, class prior {prior:.4f} "
          f"(train accuracy {accuracy(fitted.log_probs(train), train):.4f})")
    assert acc > prior + 0.05, (acc, prior)
    assert fitted.clf.converged_ and fitted.label_names == dev.label_names
    meta = fitted.meta()
    assert meta["features"] == list(FEATURE_NAMES) and meta["n_train"] == len(train) and meta["C"] == 100.0


def test_deterministic_and_label_order(cad, fitted):
    train, dev = cad
    sub = dev.subset(range(50))
    again = OverlapBias().fit(train)
    assert torch.equal(again.log_probs(sub), fitted.log_probs(sub))
    # another column order: the same model, columns permuted (balanced weights are symmetric in the classes)
    order = ("contradiction", "entailment", "neutral")
    perm = OverlapBias().fit(train, label_names=order)
    assert perm.label_names == order
    torch.testing.assert_close(perm.log_probs(sub), fitted.log_probs(sub)[:, [2, 0, 1]], rtol=0, atol=1e-5)
    # the features are those of overlap_features
    torch.testing.assert_close(fitted.clf.log_proba(overlap_features(sub.text, sub.text_pair)).float(),
                               fitted.log_probs(sub))


def test_two_class(cad):
    train, dev = cad
    ob = OverlapBias(two_class=True).fit(train)
    b = ob.log_probs(dev)
    assert b.shape == (len(dev), 3) and ob.meta()["two_class"] is True
    torch.testing.assert_close(b[:, 1], b[:, 2], rtol=0, atol=0)  # neutral and contradiction share b_not − log 2
    torch.testing.assert_close(torch.logsumexp(b, 1), torch.zeros(len(dev)), rtol=0, atol=1e-5)
    ent = torch.tensor([y == 0 for y in dev.labels])
    two_way = float(((b[:, 0] > b[:, 1:].logsumexp(1)) == ent).double().mean())
    assert two_way > 0.55  # entailment vs not, from overlap alone


def test_errors(cad):
    train, _ = cad
    single = D.CadData("sentiment", ["good film"], None, [1], [True], [0])
    with pytest.raises(ValueError, match="no text pairs .*Text.*premise/hypothesis"):
        OverlapBias().fit(single)
    with pytest.raises(RuntimeError, match="not fitted"):
        OverlapBias().log_probs(train)
    with pytest.raises(ValueError, match="are not the data's labels"):
        OverlapBias().fit(train, label_names=("entailment", "neutral"))
    spec = D.TaskSpec("custom", "label", ("a", "b"), ("same", "different"))
    pairs = D.CadData(spec, ["x y", "x"], ["x", "z"], [0, 1], [True, True], [0, 1])
    with pytest.raises(ValueError, match="two_class=True needs a label 'entailment'"):
        OverlapBias(two_class=True).fit(pairs)
    fitted = OverlapBias().fit(pairs)
    with pytest.raises(ValueError, match="no text pairs"):
        fitted.log_probs(single)
