"""cal_step_: one batched, per-sample CAL ascent step on lambda, in place (docs/METHODS.md §1.2)."""
import torch

from ..kernels import reference
from . import registry, validate
from .backend import select

registry.define({"cal_step_": "(Tensor(a!) lam, Tensor grad, float lr, float p, float lo, float hi) -> ()"}, triton="cal_step")

registry.register("cal_step_", lambda lam, grad, lr, p, lo, hi: None)

# lr >= 0 (an ascent step; 0 leaves lam as it is); lo, hi: the clamp range, an infinite end is no clamp there
SCALARS = {"lr": dict(low=0.0), "p": dict(low=1.0, what="norm order"), "lo": dict(finite=False),
           "hi": dict(finite=False)}


def cal_step_(lam, grad, lr, p=1.0, lo=0.0, hi=1.0):
    """`lam += lr * (grad - d||lam_i||_p / d lam_i)`, then clamp to [lo, hi]; per row i of lam ([B] or [B, T]). Returns lam.

    lr: a finite number >= 0; p: a finite norm order >= 1; lo <= hi: numbers, +-inf allowed (no clamp at that end)."""
    validate.tensor("lam", lam, ndims=(1, 2))
    validate.nonempty_batch("lam", lam)
    validate.tensor("grad", grad)
    validate.shape("grad", grad, lam.shape, "like lam")
    validate.same_device(lam=lam, grad=grad)
    lr, p, lo, hi = validate.scalars(SCALARS, lr=lr, p=p, lo=lo, hi=hi)
    if lo > hi:
        raise ValueError(f"lo, hi: expected lo <= hi, got lo={lo} > hi={hi}")
    backend = select("cal_step_", lam.device)
    if backend == "reference":
        return reference.cal_step_(lam, grad, lr, p, lo, hi)
    acc = registry.acc_dtype(lam.dtype)
    with torch.no_grad():
        work = lam if (lam.dtype == acc and lam.is_contiguous()) else lam.to(acc).contiguous()
        registry.kernels(backend).cal_step_(work, grad.to(acc).contiguous(), lr, p, lo, hi)
        if work is not lam:
            lam.copy_(work)
    return lam
