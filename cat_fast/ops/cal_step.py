"""cal_step_: one batched, per-sample CAL ascent step on lambda, in place (SPEC §1.2)."""
import math

import torch

from .. import _backend, reference
from . import _registry, _validate

_registry.register("cal_step_", lambda lam, grad, lr, p, lo, hi: None)


def cal_step_(lam, grad, lr, p=1.0, lo=0.0, hi=1.0):
    """`lam += lr * (grad - d||lam_i||_p / d lam_i)`, then clamp to [lo, hi]; per row i of lam ([B] or [B, T]). Returns lam."""
    _validate.tensor("lam", lam, ndims=(1, 2))
    _validate.nonempty_batch("lam", lam)
    _validate.tensor("grad", grad)
    _validate.shape("grad", grad, lam.shape, "like lam")
    _validate.same_device(lam=lam, grad=grad)
    lr, p = _validate.number("lr", lr), _validate.number("p", p)
    lo, hi = _validate.number("lo", lo), _validate.number("hi", hi)
    if not (p >= 1.0 and math.isfinite(p)):
        raise ValueError(f"p: expected a finite norm order >= 1, got {p}")
    if lo > hi:
        raise ValueError(f"lo, hi: expected lo <= hi, got lo={lo} > hi={hi}")
    backend = _backend.select("cal_step_", lam.device)
    if backend == "reference":
        return reference.cal_step_(lam, grad, lr, p, lo, hi)
    acc = _registry.acc_dtype(lam.dtype)
    with torch.no_grad():
        work = lam if (lam.dtype == acc and lam.is_contiguous()) else lam.to(acc).contiguous()
        _registry.kernels(backend).cal_step_(work, grad.to(acc).contiguous(), lr, p, lo, hi)
        if work is not lam:
            lam.copy_(work)
    return lam
