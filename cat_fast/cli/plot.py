"""``curves.png`` of ``cat-fast train``: the loss per logged step with the parts the objective declares
(`cat_fast.objectives.Curve` on the ``"loss"`` panel), dev accuracy per epoch, and one more panel per other panel
name its curves declare (CAT: λ before / after CAL and the mean CRM weight)."""
from __future__ import annotations

from typing import Dict, List, Sequence

__all__ = ["plot"]


def _series(steps, curve, warmup_steps):
    """(step, value) of `curve` over the logged `steps`: its info key under any logging prefix (``cat/``,
    ``objective/``, ...), without the warm-up where the curve says so."""
    suffix = "/" + curve.key
    key = next((k for h in steps for k in h if k.endswith(suffix) and not k.startswith("eval/")), None)
    if key is None:
        return []
    return [(h["step"], h[key]) for h in steps
            if key in h and not (curve.after_warmup and h["step"] <= warmup_steps)]


def plot(path: str, logs: List[Dict], history: List[Dict], warmup_steps: int, title: str,
         curves: Sequence = ()) -> None:
    """Write ``curves.png`` to `path` from the Trainer's log history `logs`, the per-epoch `history` and the
    objective's `curves` (those absent from the logs are left out)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    steps = [h for h in logs if "loss" in h and "step" in h]
    drawn = [(c, pts) for c in curves for pts in [_series(steps, c, warmup_steps)] if pts]
    panels = list(dict.fromkeys(c.panel for c, _ in drawn if c.panel != "loss"))
    fig, axes = plt.subplots(1, 2 + len(panels), figsize=(5 * (2 + len(panels)), 3.6))
    a, b = axes[0], axes[1]
    xs = [h["step"] for h in steps]
    a.plot(xs, [h["loss"] for h in steps], lw=0.8, alpha=0.6, label="loss")
    for curve, pts in drawn:
        if curve.panel == "loss":
            a.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.0, label=curve.label)
    if 0 < warmup_steps < (xs[-1] if xs else 0):
        a.axvspan(0, warmup_steps, color="grey", alpha=0.15, label="ERM warm-up")
    a.set_xlabel("optimizer step")
    a.set_ylabel("training loss")
    a.legend(fontsize=8)
    ev_x = [h["step"] for h in history]
    for key in sorted({k for h in history for k in h.get("eval", {})}):
        b.plot(ev_x, [h["eval"].get(key, {}).get("accuracy", float("nan")) for h in history], marker="o", label=key)
    b.set_xlabel("optimizer step (end of each epoch)")
    b.set_ylabel("accuracy")
    if history and any(h.get("eval") for h in history):
        b.legend(fontsize=8)
    for axis, panel in zip(axes[2:], panels):
        for curve, pts in drawn:
            if curve.panel == panel:
                axis.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.0, label=curve.label)
        axis.set_xlabel("optimizer step")
        axis.set_ylabel(panel)
        axis.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
