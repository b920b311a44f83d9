"""CLP's per-epoch diagnostics (docs/METHODS.md §5): what the perturbation δ' (the one the classifier's loss uses)
looks like per class and, when the batch has a ``diagnostic_group`` column, per (class, group) — its mean, its
mean size, the fraction within 1 % of the bound — and what the meta step did: the norm of Ω's meta-gradient, the
metadata loss before and after the virtual step, the virtual step's size.

Every step adds to device buffers (no host synchronisation); `record` reads them once, returns a JSON dict and
starts again. ``CLP.epoch_record`` is its caller.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

__all__ = ["CLPDiagnostics", "MAX_GROUPS", "grad_norm"]

MAX_GROUPS = 8  # group ids kept when the names are not given; larger ids count under "no group"
_SCALARS = ("steps", "meta_grad_norm", "meta_loss_before", "meta_loss_after", "meta_loss_change",
            "meta_loss_unchanged", "virtual_step")
_NEAR_BOUND = 0.99


def grad_norm(grads) -> torch.Tensor:
    """The float32 2-norm of a list of gradients (None entries skipped), detached, on their device."""
    return torch.stack([g.detach().float().pow(2).sum() for g in grads if g is not None]).sum().sqrt()


class CLPDiagnostics:
    """Accumulators of `CLP` (module docstring) for `num_classes` classes, the bound `scale`, the group names
    (``group_names``; default: ids ``0`` .. ``MAX_GROUPS - 1``) and the class names."""

    def __init__(self, num_classes: int, scale: float, device, group_names: Optional[Sequence[str]] = None,
                 class_names: Optional[Sequence[str]] = None):
        self.scale = float(scale)
        self.group_names = [str(g) for g in group_names] if group_names else [str(g) for g in range(MAX_GROUPS)]
        self.class_names = [str(c) for c in class_names] if class_names else [str(c) for c in range(num_classes)]
        G = len(self.group_names)
        self.rows = torch.zeros(num_classes, G + 1, 4, device=device)  # count, Σδ, Σ|δ|, near the bound; G: no group
        self.scalars = torch.zeros(len(_SCALARS), device=device)
        self.grad_max = torch.zeros((), device=device)

    @torch.no_grad()
    def update(self, delta, labels, groups, meta_grads, before, after, virtual_step) -> Dict:
        """One step's δ' [B], labels [B], group ids [B] (or None), Ω's meta-gradients, the metadata loss before and
        after the virtual step, and the virtual step's norm; all added on the device. Returns the step's
        ``meta_grad_norm``, ``virtual_step`` and ``meta_loss_change`` (0-d tensors, for the objective's info)."""
        C, G1, _ = self.rows.shape
        keep = (labels >= 0).float()
        if groups is None:
            g = torch.full_like(labels, G1 - 1)
        else:  # no host state here: a replayed step graph runs only the device work
            g = groups.to(labels.device).long()
            g = torch.where((g >= 0) & (g < G1 - 1), g, torch.full_like(g, G1 - 1))
        d = delta.detach().float()
        near = (d.abs() >= _NEAR_BOUND * self.scale).float()
        rows = torch.stack([torch.ones_like(d), d, d.abs(), near], 1) * keep.unsqueeze(1)
        self.rows.view(-1, 4).index_add_(0, labels.clamp_min(0) * G1 + g, rows)
        norm = grad_norm(meta_grads)
        before, after = before.detach().float(), after.detach().float()
        step = torch.as_tensor(virtual_step, dtype=torch.float32, device=norm.device).reshape(())
        self.scalars.add_(torch.stack([torch.ones_like(norm), norm, before, after, after - before,
                                       (after == before).float(), step]))
        torch.maximum(self.grad_max, norm, out=self.grad_max)
        return {"meta_grad_norm": norm, "virtual_step": step, "meta_loss_change": after - before}

    def _cells(self, rows) -> Dict:
        n = float(rows[0])
        if n == 0:
            return {"n": 0}
        return {"n": int(n), "delta_mean": float(rows[1]) / n, "delta_abs_mean": float(rows[2]) / n,
                "near_bound": float(rows[3]) / n}

    def record(self) -> Optional[Dict]:
        """The epoch's diagnostics as a JSON dict (None when no step ran), then the buffers start again. One host
        read."""
        rows, scalars, grad_max = (t.detach().to("cpu", torch.float64) for t in (self.rows, self.scalars,
                                                                                 self.grad_max))
        self.rows.zero_()
        self.scalars.zero_()
        self.grad_max.zero_()
        steps = float(scalars[0])
        if steps == 0:
            return None
        out = {"steps": int(steps), "bound": self.scale}
        out.update({k: float(v) / steps for k, v in zip(_SCALARS[1:], scalars[1:])})
        out["meta_grad_norm_max"] = float(grad_max)
        out["per_class"] = {name: self._cells(rows[c].sum(0)) for c, name in enumerate(self.class_names)}
        if rows[:, :-1, 0].sum() > 0:  # some example had a group
            out["per_group"] = {f"{cn}/{gn}": self._cells(rows[c, g]) for c, cn in enumerate(self.class_names)
                                for g, gn in enumerate(self.group_names) if rows[c, g, 0] > 0}
        return out

    def state_dict(self) -> Dict:
        return {"rows": self.rows.clone(), "scalars": self.scalars.clone(), "grad_max": self.grad_max.clone()}

    def load_state_dict(self, state) -> None:
        if state["rows"].shape == self.rows.shape:
            self.rows.copy_(state["rows"])
        self.scalars.copy_(state["scalars"])
        self.grad_max.copy_(state["grad_max"])
