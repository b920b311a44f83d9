"""cat_fast.bias.LogisticRegression against float64 truths: the gradient at its optimum, closed-form optima, and a
plain torch.optim.LBFGS minimisation of the same objective (docs/METHODS.md §4)."""
import math
import warnings

import pytest
import torch

from cat_fast.bias import LogisticRegression

F64 = torch.float64


def problem(n=240, f=4, k=3, seed=0):
    """Overlapping Gaussian classes, unbalanced (weights matter), features on different scales."""
    g = torch.Generator().manual_seed(seed)
    y = torch.multinomial(torch.tensor([0.5, 0.3, 0.2][:k]), n, replacement=True, generator=g)
    centres = torch.randn(k, f, generator=g, dtype=F64)
    X = centres[y] + 1.5 * torch.randn(n, f, generator=g, dtype=F64)
    return X * torch.tensor([1.0, 10.0, 0.1, 3.0][:f], dtype=F64) + 5.0, y


def objective(clf, X, y, W, b):
    """Σ_i s_i CE(W z_i + b, y_i) + ‖W‖²/(2C) on the model's standardised features, balanced s_i."""
    Z = (X - clf.mean_) / clf.scale_
    k = clf.num_classes
    counts = torch.bincount(y, minlength=k).to(F64)
    s = (len(y) / (k * counts))[y] if clf.class_weight == "balanced" else torch.ones(len(y), dtype=F64)
    ce = torch.nn.functional.cross_entropy(Z @ W + b, y, reduction="none")
    return (s * ce).sum() + W.pow(2).sum() / (2 * clf.C)


@pytest.mark.parametrize("C", [100.0, 0.5])
@pytest.mark.parametrize("class_weight", ["balanced", None])
def test_gradient_zero_at_optimum(C, class_weight):
    X, y = problem()
    clf = LogisticRegression(C=C, class_weight=class_weight).fit(X, y, num_classes=3)
    assert clf.converged_ and clf.n_iter_ < 30
    W = clf.coef_.clone().requires_grad_()
    b = clf.intercept_.clone().requires_grad_()
    gW, gb = torch.autograd.grad(objective(clf, X, y, W, b), (W, b))
    assert gW.abs().max() < 1e-9 * len(y) and gb.abs().max() < 1e-9 * len(y)
    # standardised with the training statistics; the intercept kept centred
    torch.testing.assert_close(clf.mean_, X.mean(0))
    torch.testing.assert_close(clf.scale_, X.std(0, unbiased=False))
    assert abs(float(clf.intercept_.sum())) < 1e-12
    lp = clf.log_proba(X)
    assert lp.dtype == F64 and lp.shape == (len(y), 3)
    torch.testing.assert_close(torch.logsumexp(lp, 1), torch.zeros(len(y), dtype=F64), rtol=0, atol=1e-14)
    assert torch.equal(clf.predict(X), lp.argmax(1))


def test_agrees_with_lbfgs_reference():
    X, y = problem(seed=1)
    clf = LogisticRegression(C=10.0).fit(X, y)
    W = torch.zeros(4, 3, dtype=F64, requires_grad=True)
    b = torch.zeros(3, dtype=F64, requires_grad=True)
    opt = torch.optim.LBFGS([W, b], lr=1, max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-15,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = objective(clf, X, y, W, b)
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    ref = torch.log_softmax(((X - clf.mean_) / clf.scale_) @ W.detach() + b.detach(), 1)
    torch.testing.assert_close(clf.log_proba(X), ref, rtol=0, atol=1e-7)
    torch.testing.assert_close(clf.coef_, W.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(clf.intercept_, b.detach() - b.detach().mean(), rtol=0, atol=1e-6)
    with torch.no_grad():
        assert float(objective(clf, X, y, clf.coef_, clf.intercept_)) <= float(objective(clf, X, y, W, b)) + 1e-9


def test_closed_form_uninformative_features():
    """Constant features: only the intercept learns. Balanced weights give the uniform distribution whatever the
    class frequencies; without weights, the class frequencies."""
    y = torch.tensor([0] * 6 + [1] * 3 + [2] * 1)
    X = torch.full((10, 2), 7.0, dtype=F64)
    lp = LogisticRegression().fit(X, y).log_proba(X)
    torch.testing.assert_close(lp, torch.full((10, 3), -math.log(3), dtype=F64), rtol=0, atol=1e-12)
    lp = LogisticRegression(class_weight=None).fit(X, y).log_proba(X[:1])
    torch.testing.assert_close(lp[0].exp(), torch.tensor([0.6, 0.3, 0.1], dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("class_weight", [None, "balanced"])
def test_closed_form_saturated_binary_feature(class_weight):
    """One binary feature, two classes, (almost) no penalty: p(y|x) is the (class-weighted) frequency within x."""
    n = {(0, 0): 30, (0, 1): 10, (1, 0): 5, (1, 1): 15}  # (x, y) -> count
    X = torch.tensor([[float(x)] for (x, _), c in n.items() for _ in range(c)], dtype=F64)
    y = torch.tensor([k for (_, k), c in n.items() for _ in range(c)])
    clf = LogisticRegression(C=1e9, class_weight=class_weight).fit(X, y)
    n_y = {k: n[(0, k)] + n[(1, k)] for k in (0, 1)}
    w = {k: (1.0 if class_weight is None else 1.0 / n_y[k]) for k in (0, 1)}
    for x in (0, 1):
        p1 = w[1] * n[(x, 1)] / (w[0] * n[(x, 0)] + w[1] * n[(x, 1)])
        got = clf.log_proba(torch.tensor([[float(x)]], dtype=F64))[0, 1].exp()
        assert abs(float(got) - p1) < 1e-6, (x, float(got), p1)


def test_deterministic_and_inputs():
    X, y = problem(seed=2)
    a = LogisticRegression().fit(X, y)
    b = LogisticRegression().fit(X.clone(), y.clone())
    assert torch.equal(a.coef_, b.coef_) and torch.equal(a.intercept_, b.intercept_)
    # float32 features and lists are accepted (computed in float64)
    c = LogisticRegression().fit(X.float(), y.tolist())
    torch.testing.assert_close(c.log_proba(X.float()), a.log_proba(X), rtol=0, atol=1e-5)


def test_errors():
    X, y = problem(n=30)
    with pytest.raises(ValueError, match="C=0"):
        LogisticRegression(C=0)
    with pytest.raises(ValueError, match="C=inf"):
        LogisticRegression(C=float("inf"))
    with pytest.raises(ValueError, match="class_weight='auto'"):
        LogisticRegression(class_weight="auto")
    with pytest.raises(RuntimeError, match="not fitted"):
        LogisticRegression().log_proba(X)
    with pytest.raises(ValueError, match=r"class\(es\) \[3\] have no training example"):
        LogisticRegression().fit(X, y, num_classes=4)
    with pytest.raises(ValueError, match="labels range over"):
        LogisticRegression().fit(X, y, num_classes=2)
    with pytest.raises(ValueError, match=r"expected integer labels \[30\]"):
        LogisticRegression().fit(X, y[:-1])
    with pytest.raises(ValueError, match=r"expected \[N, F\]"):
        LogisticRegression().fit(X[0], y)
    bad = X.clone()
    bad[4, 1] = float("nan")
    with pytest.raises(ValueError, match=r"X\[4\] is not finite"):
        LogisticRegression().fit(bad, y)
    clf = LogisticRegression().fit(X, y)
    with pytest.raises(ValueError, match="fitted on 4"):
        clf.log_proba(X[:, :3])


def test_not_converged_warns():
    X, y = problem(n=60)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        clf = LogisticRegression(max_iter=1).fit(X, y)
    assert not clf.converged_ and any("stopped after 1 iteration" in str(x.message) for x in w)


def test_agrees_with_scikit_learn():
    """The same minimiser as scikit-learn's multinomial, class-balanced LogisticRegression on standardised features."""
    sklearn = pytest.importorskip("sklearn.linear_model")
    X, y = problem(n=300, seed=3)
    ours = LogisticRegression(C=1.0).fit(X, y)
    Z = ((X - ours.mean_) / ours.scale_).numpy()
    ref = sklearn.LogisticRegression(C=1.0, class_weight="balanced", tol=1e-12, max_iter=10000).fit(Z, y.numpy())
    torch.testing.assert_close(ours.log_proba(X), torch.from_numpy(ref.predict_log_proba(Z)), rtol=0, atol=1e-5)
