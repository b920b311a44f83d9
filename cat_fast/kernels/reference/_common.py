"""Helpers shared by the reference ops."""


def max_softmax(z):
    """Phi(z) = max_c softmax(z)_c per row, with its gradient at the FIRST index of the maximum logit (the convention
    of every backend, docs/KERNELS.md): softmax gathered at `argmax` (which returns the first of tied maxima), not
    `amax` (whose backward splits the gradient between ties)."""
    return z.softmax(-1).gather(-1, z.argmax(-1, keepdim=True)).squeeze(-1)
