"""Multinomial logistic regression in torch, the classifier of the overlap bias model (docs/METHODS.md §4).

Typical use::

    clf = LogisticRegression(C=100.0).fit(X_train, y_train, num_classes=3)   # X [N, F] float, y [N] int
    log_p = clf.log_proba(X_dev)                                              # [M, 3], rows sum to 1 in exp

What ``fit`` minimises, in float64, on features standardised with the training mean and standard deviation
(``z = (x − mean_) / scale_``; a constant feature gets scale 1, so it is 0):

    Σ_i s_i · CE(W z_i + b, y_i) + ‖W‖² / (2C),     s_i = N / (K · N_{y_i})   (balanced class weights)

— the minimiser of scikit-learn's ``LogisticRegression(C=C, class_weight="balanced")`` with a multinomial loss;
the intercept ``b`` is not penalised. Clark et al. use ``C = 100`` (liblinear, one-vs-rest for 2 classes, raw
features, a penalised intercept), so the fitted numbers differ from theirs, not the kind of model. The problem is
strictly convex up to adding a constant to ``b``, which changes no probability; Newton's method with a backtracking
line search solves it to ``max |∇| ≤ tol · N`` (a few iterations), and ``b`` is kept centred. Deterministic: no
randomness, a fixed sequence of float64 operations.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch

__all__ = ["LogisticRegression"]


class LogisticRegression:
    """Multinomial, L2-regularised (``C``: the inverse penalty), class-balanced logistic regression.

    After :meth:`fit`: ``coef_`` ``[F, K]`` and ``intercept_`` ``[K]`` (on standardised features), ``mean_`` and
    ``scale_`` ``[F]``, ``num_classes``, ``n_iter_``, ``converged_``; all float64 on the CPU.
    """

    def __init__(self, C: float = 100.0, class_weight: Optional[str] = "balanced", max_iter: int = 100,
                 tol: float = 1e-10):
        if not (isinstance(C, (int, float)) and math.isfinite(C) and C > 0):
            raise ValueError(f"LogisticRegression: C={C!r}; expected a finite number > 0 (the inverse of the L2 "
                             f"penalty; Clark et al. use 100)")
        if class_weight not in ("balanced", None):
            raise ValueError(f"LogisticRegression: class_weight={class_weight!r}; expected 'balanced' or None")
        if not (isinstance(max_iter, int) and max_iter >= 1):
            raise ValueError(f"LogisticRegression: max_iter={max_iter!r}; expected an integer >= 1")
        if not (isinstance(tol, (int, float)) and tol > 0):
            raise ValueError(f"LogisticRegression: tol={tol!r}; expected a number > 0")
        self.C = float(C)
        self.class_weight = class_weight
        self.max_iter = max_iter
        self.tol = float(tol)
        self.coef_: Optional[torch.Tensor] = None

    # -- inputs
    @staticmethod
    def _features(X, num_features: Optional[int] = None) -> torch.Tensor:
        X = torch.as_tensor(X)
        if X.dim() != 2:
            raise ValueError(f"LogisticRegression: X has shape {tuple(X.shape)}; expected [N, F]")
        if num_features is not None and X.shape[1] != num_features:
            raise ValueError(f"LogisticRegression: X has {X.shape[1]} features; the model was fitted on "
                             f"{num_features}")
        X = X.detach().to("cpu", torch.float64)
        if not torch.isfinite(X).all():
            row = int((~torch.isfinite(X)).any(1).nonzero()[0])
            raise ValueError(f"LogisticRegression: X[{row}] is not finite; expected finite features")
        return X

    def _standardise(self, X: torch.Tensor) -> torch.Tensor:
        return torch.cat([(X - self.mean_) / self.scale_, torch.ones(X.shape[0], 1, dtype=X.dtype)], 1)

    # -- the objective, its gradient and Hessian in theta = [W; b] ([F + 1, K])
    def _objective(self, Z, Y, s, theta):
        logits = Z @ theta
        ce = torch.logsumexp(logits, 1) - (logits * Y).sum(1)
        return (s * ce).sum() + theta[:-1].pow(2).sum() / (2 * self.C)

    def _newton_system(self, Z, Y, s, theta):
        F1, K = theta.shape
        P = torch.softmax(Z @ theta, 1)
        penalty = torch.ones(F1, 1, dtype=Z.dtype)
        penalty[-1] = 0.0  # the intercept is not penalised
        grad = Z.T @ (s[:, None] * (P - Y)) + penalty * theta / self.C
        # H[(a,k),(c,l)] = Σ_i s_i z_ia z_ic (P_ik δ_kl − P_ik P_il) + δ_ac δ_kl [a < F] / C
        A = s[:, None, None] * (torch.diag_embed(P) - P[:, :, None] * P[:, None, :])
        H = torch.einsum("ia,ic,ikl->akcl", Z, Z, A).reshape(F1 * K, F1 * K)
        H = H + torch.diag((penalty.expand(F1, K) / self.C).reshape(-1))
        # H's one null direction is b + c·1 (no change in any probability; the gradient is orthogonal to it):
        # adding u uᵀ along it makes H positive definite without changing the step on the other directions
        u = torch.zeros(F1, K, dtype=Z.dtype)
        u[-1] = 1.0 / math.sqrt(K)
        H = H + torch.outer(u.reshape(-1), u.reshape(-1))
        return grad, H

    # -- fitting and prediction
    def fit(self, X, y, num_classes: Optional[int] = None) -> "LogisticRegression":
        """Fit on features ``X`` ``[N, F]`` and labels ``y`` ``[N]`` in ``0..num_classes − 1`` (default:
        ``max(y) + 1``). Every class needs at least one example. Returns ``self``."""
        X = self._features(X)
        y = torch.as_tensor(y)
        if y.dim() != 1 or y.shape[0] != X.shape[0] or y.is_floating_point() or y.dtype == torch.bool:
            raise ValueError(f"LogisticRegression: y has shape {tuple(y.shape)} and dtype {y.dtype}; expected integer "
                             f"labels [{X.shape[0]}] (one per row of X)")
        if X.shape[0] == 0:
            raise ValueError("LogisticRegression: no examples; expected at least one row in X")
        y = y.to("cpu", torch.long)
        K = int(y.max()) + 1 if num_classes is None else num_classes
        if not (isinstance(K, int) and K >= 2):
            raise ValueError(f"LogisticRegression: num_classes={K!r}; expected an integer >= 2")
        if int(y.min()) < 0 or int(y.max()) >= K:
            raise ValueError(f"LogisticRegression: labels range over {int(y.min())}..{int(y.max())}; expected "
                             f"0..{K - 1} (num_classes={K})")
        counts = torch.bincount(y, minlength=K)
        if (counts == 0).any():
            missing = [k for k in range(K) if counts[k] == 0]
            raise ValueError(f"LogisticRegression: class(es) {missing} have no training example; every class of "
                             f"num_classes={K} needs at least one")
        N, F = X.shape
        self.num_classes = K
        self.mean_ = X.mean(0)
        std = X.std(0, unbiased=False)
        self.scale_ = torch.where(std > 0, std, torch.ones_like(std))
        Z = self._standardise(X)
        Y = torch.nn.functional.one_hot(y, K).to(torch.float64)
        s = (N / (K * counts.to(torch.float64)))[y] if self.class_weight == "balanced" else torch.ones(N, dtype=torch.float64)
        theta = torch.zeros(F + 1, K, dtype=torch.float64)
        f = self._objective(Z, Y, s, theta)
        self.converged_ = False
        for it in range(1, self.max_iter + 1):
            grad, H = self._newton_system(Z, Y, s, theta)
            self.n_iter_ = it
            if grad.abs().max() <= self.tol * N:
                self.converged_ = True
                break
            step = -torch.linalg.solve(H, grad.reshape(-1)).reshape(F + 1, K)
            slope = float((grad * step).sum())
            t = 1.0
            while True:  # backtracking (Armijo)
                cand = theta + t * step
                f_cand = self._objective(Z, Y, s, cand)
                if f_cand <= f + 1e-4 * t * slope or t < 1e-10:
                    break
                t *= 0.5
            if t < 1e-10:  # no descent left at float64 precision: the optimum up to rounding
                self.converged_ = bool(grad.abs().max() <= 1e-6 * N)
                break
            theta, f = cand, f_cand
            theta[-1] -= theta[-1].mean()  # the intercept's free constant: keep it centred
        if not self.converged_:
            warnings.warn(f"LogisticRegression: Newton's method stopped after {self.n_iter_} iteration(s) with "
                          f"max |gradient| = {float(grad.abs().max()):.3g} (tol·N = {self.tol * N:.3g}); raise "
                          f"max_iter or lower C", RuntimeWarning, stacklevel=2)
        self.coef_, self.intercept_ = theta[:-1].clone(), theta[-1].clone()
        return self

    def _check_fitted(self):
        if self.coef_ is None:
            raise RuntimeError("LogisticRegression: not fitted yet; call fit(X, y) first")

    def decision_function(self, X) -> torch.Tensor:
        """Logits ``[N, K]`` (float64)."""
        self._check_fitted()
        X = self._features(X, self.coef_.shape[0])
        return ((X - self.mean_) / self.scale_) @ self.coef_ + self.intercept_

    def log_proba(self, X) -> torch.Tensor:
        """Log-probabilities ``[N, K]`` (float64, each row's logsumexp is 0)."""
        return torch.log_softmax(self.decision_function(X), 1)

    def predict(self, X) -> torch.Tensor:
        return self.decision_function(X).argmax(1)
