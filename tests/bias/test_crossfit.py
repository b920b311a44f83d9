"""cross_fit: a row's prediction comes from a model that did not see it (flipping its own label leaves it as it
was, while the in-sample prediction moves), groups stay in one fold, folds are balanced and seeded, and the fold
counts the data cannot give are refused."""
import pytest
import torch

from cat_fast import bias, data


def table(n=24, group_size=1):
    """Examples with one categorical column `cue` (in `cues`) and labels; rows of a group share a group id."""
    spec = data.core.TaskSpec("custom", "label", ("text",), ("neg", "pos"))
    labels = [(i * 7 // 3) % 2 for i in range(n)]
    groups = [i // group_size for i in range(n)]
    is_orig = [i % group_size == 0 for i in range(n)]
    d = data.CadData(spec, [f"t{i}" for i in range(n)], None, labels, is_orig, groups, pairing="all")
    cues = bias.FeatureColumn("cue", "categorical", ["ab"[i % 2] for i in range(n)])
    return d, [cues]


def exact_fit(d, cols, labels):
    def fit(rows):
        model = bias.FeatureBias("exact", smoothing=1.0).fit(cols, labels, 2, rows)
        return lambda held: model.log_probs(cols, held)
    return fit


@pytest.mark.parametrize("group_size", [1, 3])
def test_a_row_never_sees_its_own_label(group_size):
    d, cols = table(group_size=group_size)
    base = bias.cross_fit(d, exact_fit(d, cols, d.labels), folds=4, seed=1)
    in_sample = bias.cross_fit(d, exact_fit(d, cols, d.labels), folds=1)
    for i in (0, 5, 13):
        flipped = list(d.labels)
        flipped[i] = 1 - flipped[i]
        cf = bias.cross_fit(d, exact_fit(d, cols, flipped), folds=4, seed=1, labels=flipped)
        assert cf.fold == base.fold
        torch.testing.assert_close(cf.log_probs[i], base.log_probs[i], rtol=0, atol=0)
        same_fold = [j for j in range(len(d)) if base.fold[j] == base.fold[i]]
        torch.testing.assert_close(cf.log_probs[same_fold], base.log_probs[same_fold], rtol=0, atol=0)
        moved = bias.cross_fit(d, exact_fit(d, cols, flipped), folds=1, labels=flipped)
        assert not torch.equal(moved.log_probs[i], in_sample.log_probs[i])


def test_groups_stay_in_one_fold_and_folds_are_balanced():
    d, _ = table(n=30, group_size=3)
    fold = bias.assign_folds(d, 4, seed=0)
    for members in d.groups:
        assert len({fold[i] for i in members}) == 1
    sizes = sorted(fold.count(k) for k in range(4))
    assert sizes == [6, 6, 9, 9]  # 10 groups of 3 over 4 folds
    assert fold == bias.assign_folds(d, 4, seed=0) and fold != bias.assign_folds(d, 4, seed=1)


def test_held_out_accuracy_per_fold():
    d, cols = table()
    cf = bias.cross_fit(d, exact_fit(d, cols, d.labels), folds=3)
    assert cf.folds == 3 and sum(cf.fold_sizes) == len(d) and len(cf.fold_accuracy) == 3
    for k in range(3):
        held = [i for i in range(len(d)) if cf.fold[i] == k]
        hits = (cf.log_probs[held].argmax(1) == torch.tensor([d.labels[i] for i in held])).double().mean()
        assert cf.fold_accuracy[k] == pytest.approx(float(hits))
    one = bias.cross_fit(d, exact_fit(d, cols, d.labels), folds=1)
    assert one.fold == [0] * len(d) and one.fold_sizes == [len(d)]


@pytest.mark.parametrize("folds, words", [
    (0, "expected an integer >= 1"),
    (9, "the training data has 8 counterfactual groups (a group stays in one fold); expected at most 8 folds"),
])
def test_fold_counts_the_data_cannot_give(folds, words):
    d, cols = table(group_size=3)
    with pytest.raises(bias.CrossFitError) as e:
        bias.cross_fit(d, exact_fit(d, cols, d.labels), folds=folds)
    assert words in str(e.value) and e.value.folds == folds


def test_rows_not_groups_without_groups_and_one_class_outside_a_fold():
    d, cols = table(n=5)
    with pytest.raises(bias.CrossFitError, match="has 5 rows; expected at most 5 folds"):
        bias.assign_folds(d, 6)
    labels = [0, 0, 0, 0, 1]
    d2 = d.subset(range(5))
    d2.labels[:] = labels
    with pytest.raises(bias.CrossFitError, match="have one class"):
        bias.cross_fit(d2, exact_fit(d2, cols, labels), folds=5)


def test_fit_temperature_undoes_a_known_over_confidence():
    """Labels drawn from softmax(z): predictions log_softmax(5 z) are over-confident by a factor 5; the fitted
    inverse temperature brings them back near 1/5, lowers the NLL, and leaves calibrated predictions near beta 1."""
    from cat_fast.bias import fit_temperature

    g = torch.Generator().manual_seed(0)
    z = torch.randn(4000, 3, generator=g, dtype=torch.float64)
    y = torch.multinomial(z.softmax(-1), 1, generator=g).squeeze(1).tolist()
    over = fit_temperature(torch.log_softmax(5 * z, -1), y)
    assert abs(over.beta - 0.2) < 0.03 and over.nll_after < over.nll_before
    assert over.confidence_after < over.confidence_before
    assert abs(fit_temperature(torch.log_softmax(z, -1), y).beta - 1.0) < 0.15
    torch.testing.assert_close(over.apply(torch.log_softmax(5 * z, -1)), torch.log_softmax(5 * z * over.beta, -1))


def test_fit_temperature_refuses_bad_input():
    from cat_fast.bias import fit_temperature

    with pytest.raises(ValueError, match="expected log_probs"):
        fit_temperature(torch.zeros(3, 2), [0, 1])
    with pytest.raises(ValueError, match="NaN"):
        fit_temperature(torch.tensor([[float("nan"), 0.0]]), [0])
