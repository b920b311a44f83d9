"""Gradient unlearning of selected neurons (docs/METHODS.md §3; Sae Lim et al. 2024 and their released code).

    from cat_fast.analysis import unlearning
    stats = unlearning.unlearn(model, nie.top(175), batches, lr=1e-5, epochs=15)

Only the parameters that produce the selected neurons train: for query / key / value / intermediate the row of the
Linear that outputs the neuron (weight row and bias entry); for attention_output / output (after a LayerNorm) the
row of the block's Linear before the norm and the norm's weight and bias entries of that neuron. Their gradient is
reversed (an ascent step on the cross-entropy). Each step is AdamW on those tensors, after which every other entry is
copied back, so every other parameter of the model stays bit-identical (weight decay included), as the released code
does. ``advantaged=True`` (the paper's setting) keeps only the rows that the bias model gets right and the model gets
wrong: the batch needs ``bias`` [B, C] (the bias model's log-probabilities) beside ``labels``. Those rows are chosen
once, before the first step, with the model in eval mode (`advantaged_rows`): a fixed set, the one whose size the
paper scales its learning rate by. Re-choosing them at every step would let the ascent grow its own training set
(each step makes the model wrong on more examples).
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .. import models
from ..models import families
from .masking import normalise_neurons

__all__ = ["unlearn", "producing_parameters", "advantaged_rows"]

_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def producing_parameters(model, neurons: Iterable[Sequence]) -> List[Tuple[torch.nn.Parameter, torch.Tensor]]:
    """(parameter, index of its first dimension) pairs whose entries produce `neurons` (module docstring)."""
    chosen = normalise_neurons(model, neurons)
    st = models.structure(model)
    rows: Dict[int, Tuple[torch.nn.Parameter, set]] = {}

    def add(param, index):
        if param is None:
            return
        rows.setdefault(id(param), (param, set()))[1].add(index)

    for layer, comp, index in chosen:
        linear, norm = families.producer(st.layer_modules[layer - 1], comp)  # the family's table entry
        add(linear.weight, index)
        add(linear.bias, index)
        if norm is not None:
            add(norm.weight, index)
            add(norm.bias, index)
    return [(param, torch.tensor(sorted(idx))) for param, idx in rows.values()]


def advantaged_rows(model, batches: Iterable[dict], candidate_class: Optional[int] = None) -> List[torch.Tensor]:
    """Per batch, a bool [B] of its advantaged rows: ``bias`` (the bias model's log-probabilities [B, C]) right and
    the model (in eval mode, no gradient) wrong; with `candidate_class` only rows of that gold class (the released
    code's ``candidated_class``, "entailment" for NLI: the bias predicts it, it is the label, the model misses it).
    The model is left in the train/eval mode it had."""
    if candidate_class is not None and (isinstance(candidate_class, bool) or not isinstance(candidate_class, int)
                                        or candidate_class < 0):
        raise ValueError(f"candidate_class: expected a class index >= 0 or None, got {candidate_class!r}")
    was = model.training
    out = []
    try:
        model.eval()
        with torch.no_grad():
            for batch in batches:
                if "labels" not in batch:
                    raise ValueError("batches: each batch needs 'labels'")
                if "bias" not in batch:
                    raise ValueError("batches: advantaged=True needs batch['bias'] (the bias model's "
                                     "log-probabilities [B, C])")
                logits = models.logits_of(model(**{k: v for k, v in batch.items() if k in _INPUTS}))
                labels = batch["labels"]
                bias = batch["bias"].to(logits.device)
                if candidate_class is not None and candidate_class >= logits.shape[-1]:
                    raise ValueError(f"candidate_class: expected an index in [0, {logits.shape[-1]}), got "
                                     f"{candidate_class}")
                keep = (bias.argmax(-1) == labels) & (logits.argmax(-1) != labels)
                if candidate_class is not None:
                    keep &= labels == candidate_class
                out.append(keep)
    finally:
        model.train(was)
    return out


def _bar(total: int, shown: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="unlearning", unit="step", disable=not shown, leave=False)


def unlearn(model, neurons, batches: Iterable[dict], lr: float = 1e-5, epochs: int = 1, weight_decay: float = 0.1,
            advantaged: bool = True, candidate_class: Optional[int] = None, progress: bool = False) -> Dict[str, float]:
    """Gradient unlearning (module docstring) over `batches` (dicts of model inputs, ``labels`` and, with
    `advantaged`, ``bias``) for `epochs` passes. Returns {"steps", "rows_used", "mean_loss"}; the model is left in
    the train/eval mode it had. ``progress``: a progress bar over the steps (epoch and running loss) on stderr."""
    for name, value, low in (("lr", lr, 0.0), ("weight_decay", weight_decay, 0.0)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
            raise ValueError(f"{name}: expected a finite number >= {low}, got {value!r}")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs: expected an integer >= 1, got {epochs!r}")
    batches = list(batches)
    targets = producing_parameters(model, neurons)
    keeps = advantaged_rows(model, batches, candidate_class) if advantaged else [None] * len(batches)
    params = [p for p, _ in targets]
    masks = []
    for p, idx in targets:
        m = torch.zeros(p.shape[0], dtype=torch.bool, device=p.device)
        m[idx.to(p.device)] = True
        masks.append(m.view(-1, *([1] * (p.dim() - 1))))
    frozen = {p: p.requires_grad for p in model.parameters()}
    was = model.training
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    steps, used, total = 0, 0, 0.0
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        model.train()
        bar = _bar(epochs * len(batches), progress)
        for epoch in range(epochs):
            for batch, keep in zip(batches, keeps):
                bar.update(1)
                if "labels" not in batch:
                    raise ValueError("batches: each batch needs 'labels'")
                labels = batch["labels"]
                if keep is None:
                    keep = torch.ones_like(labels, dtype=torch.bool)
                n = int(keep.sum())
                if n == 0:
                    continue
                inputs = {k: v for k, v in batch.items() if k in _INPUTS}
                logits = models.logits_of(model(**inputs))
                loss = F.cross_entropy(logits.float()[keep], labels[keep])
                saved = [p.detach().clone() for p in params]
                optimizer.zero_grad(set_to_none=True)
                (-loss).backward()  # the reversed gradient: an ascent step on the cross-entropy
                for p, m in zip(params, masks):
                    if p.grad is not None:
                        p.grad.mul_(m)
                optimizer.step()
                with torch.no_grad():
                    for p, m, old in zip(params, masks, saved):
                        p.copy_(torch.where(m, p, old))  # every other entry back to its value, decay included
                steps += 1
                used += n
                total += float(loss.detach())
                bar.set_postfix({"epoch": epoch + 1, "loss": f"{total / steps:.4f}"}, refresh=False)
        bar.close()
    finally:
        for p, flag in frozen.items():
            p.requires_grad_(flag)
        model.train(was)
    return {"steps": steps, "rows_used": used, "mean_loss": total / steps if steps else float("nan")}
