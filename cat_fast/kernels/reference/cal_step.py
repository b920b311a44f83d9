"""One CAL ascent step on lambda (docs/METHODS.md §1.2): lam += lr * (grad - d||lam_i||_p / d lam_i), clamped to [lo, hi]."""
import torch


def cal_step_(lam, grad, lr, p=1.0, lo=0.0, hi=1.0):
    with torch.no_grad():
        work = lam.double()
        rows = work.reshape(work.shape[0], -1)
        if p == 1.0:
            dnorm = torch.sign(rows)
        else:
            norm = rows.abs().pow(p).sum(1, keepdim=True).pow(1.0 / p)
            ratio = torch.where(norm > 0, rows.abs() / norm.clamp_min(torch.finfo(work.dtype).tiny), 0)
            dnorm = torch.sign(rows) * ratio.pow(p - 1)
        rows = (rows + lr * (grad.double().reshape_as(rows) - dnorm)).clamp(lo, hi)
        lam.copy_(rows.reshape(lam.shape))
    return lam
