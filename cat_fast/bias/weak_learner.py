"""A weak learner as the bias model when the bias is not named (docs/METHODS.md §4): a small classifier
fine-tuned briefly on a small random subset (Utama et al. 2020: 2,000 examples, a few epochs), optionally with only
its first encoder layers (a limited-capacity model, Sanh et al. 2021). Its predictions stand in for ``b``.

Typical use::

    wl = WeakLearner("minilm", subset=2000, epochs=3, layers=None, seed=0)
    wl.fit(train, rows=None)                  # rows: the examples it may draw its subset from (default: all)
    b = wl.log_probs(train)                   # [N, C] float64, columns in train.label_names order

Training is cat_fast's plain loop: the loss ``loss`` (``"ce"``: the ERM objective, `cat_fast.objectives.build("erm",
model)`; ``"gce"``: :func:`gce_loss` with ``gce_q``, which keeps the learner on the feature it fits first), AdamW at
``lr``, batches of ``batch_size`` drawn in a seeded order, ``max_length`` tokens, the head drawn afresh for the
data's labels. Deterministic on the CPU for a given ``seed``. Use with :func:`~cat_fast.bias.cross_fit` (or a subset
much smaller than the data) so that a row's prediction does not come from a model trained on it.
"""
from __future__ import annotations

import random
from typing import Any, Dict, List, Optional, Sequence

import torch

__all__ = ["WeakLearner", "WeakLearnerError", "gce_loss", "LOSSES"]

LOSSES = ("ce", "gce")


class WeakLearnerError(ValueError):
    """An option of :class:`WeakLearner` the data or model cannot take (``option``, ``value``, ``reason``)."""

    def __init__(self, option: str, value, reason: str):
        self.option, self.value, self.reason = option, value, reason
        super().__init__(f"WeakLearner: {option}={value!r}: {reason}")


def _check_int(name: str, value, low: int, optional: bool = False) -> Optional[int]:
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise WeakLearnerError(name, value, f"expected an integer >= {low}")
    return value


def gce_loss(logits: torch.Tensor, labels: torch.Tensor, q: float = 0.7) -> torch.Tensor:
    """The mean generalized cross-entropy ``(1 − p_y^q) / q`` of ``logits`` ``[n, C]`` (Zhang & Sabuncu 2018; the
    biased model of Nam et al. 2020): its gradient is cross-entropy's times ``p_y^q``, so rows the model already
    fits weigh more than rows against it, and what it learns first (a shortcut) is amplified, not corrected.
    ``q → 0`` is cross-entropy; ``q = 1`` is the mean absolute error ``1 − p_y``."""
    p_y = torch.softmax(logits.float(), dim=-1).gather(1, labels.long()[:, None]).squeeze(1)
    return ((1.0 - p_y.clamp_min(1e-12) ** q) / q).mean()


def keep_first_layers(model, layers: int) -> int:
    """Keep the first ``layers`` encoder layers of ``model`` (in place); returns how many it had."""
    from ..models import structure

    name = structure(model).layer_list_name
    layer_list = model.get_submodule(name)
    total = len(layer_list)
    if layers > total:
        raise WeakLearnerError("layers", layers, f"the model has {total} encoder layers; expected 1..{total}")
    del layer_list[layers:]
    model.config.num_hidden_layers = layers
    return total


class WeakLearner:
    """A classifier (``model``: ``"minilm"`` or a directory, `cat_fast.models.pretrained.load_classifier`) fine-tuned
    on ``subset`` examples for ``epochs`` epochs, ``layers`` first encoder layers kept (``None``: all), with the
    ``loss`` ``"gce"`` (the default; ``gce_q``) or ``"ce"``. Cross-entropy can go on within a few epochs from the
    first feature it learns (a planted cue) to the task itself, and a bias model that has learned the task leaves a
    bias-model loss nothing to keep; generalized cross-entropy stays with the first feature longer."""

    def __init__(self, model: str = "minilm", subset: int = 2000, epochs: int = 3, layers: Optional[int] = None,
                 lr: float = 5e-5, batch_size: int = 32, max_length: int = 128, seed: int = 0, device="cpu",
                 loss: str = "gce", gce_q: float = 0.7):
        self.model_name = model
        self.subset = _check_int("subset", subset, 1)
        self.epochs = _check_int("epochs", epochs, 1)
        self.layers = _check_int("layers", layers, 1, optional=True)
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.max_length = _check_int("max_length", max_length, 2)
        self.seed = _check_int("seed", seed, 0)
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
            raise WeakLearnerError("lr", lr, "expected a finite number > 0")
        self.lr, self.device = float(lr), torch.device(device)
        if loss not in LOSSES:
            raise WeakLearnerError("loss", loss, f"expected one of {', '.join(LOSSES)}")
        if isinstance(gce_q, bool) or not isinstance(gce_q, (int, float)) or not 0 < gce_q <= 1:
            raise WeakLearnerError("gce_q", gce_q, "expected a number in (0, 1]")
        self.loss, self.gce_q = loss, float(gce_q)
        self.model = None

    def _draw(self, data, rows: List[int]) -> List[int]:
        chosen = sorted(random.Random(self.seed).sample(rows, min(self.subset, len(rows))))
        classes = sorted({data.labels[i] for i in chosen})
        if len(classes) < 2:
            name = data.label_names[classes[0]]
            raise WeakLearnerError("subset", self.subset, f"the {len(chosen)} example(s) drawn all have the label "
                                                          f"{name!r}; expected at least two classes (a larger subset)")
        return chosen

    def fit(self, data, rows: Optional[Sequence[int]] = None) -> "WeakLearner":
        """Fine-tune on a random subset of ``rows`` of ``data`` (default: all rows)."""
        from .. import objectives
        from ..data import Collator, TokenizedData
        from ..models.pretrained import load_classifier

        rows = list(range(len(data))) if rows is None else list(rows)
        chosen = self._draw(data, rows)
        names = tuple(data.label_names)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model, self.tokenizer = load_classifier(self.model_name, len(names), label_names=names, new_head=True)
            self.total_layers = model.config.num_hidden_layers
            if self.layers is not None:
                self.total_layers = keep_first_layers(model, self.layers)
            model.to(self.device).train()
            objective = objectives.build("erm", model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr)
            part = data.subset(chosen)
            tokenized = TokenizedData(part, self.tokenizer, self.max_length)
            collate = Collator(self.tokenizer)
            order = random.Random(self.seed + 1)
            for _ in range(self.epochs):
                index = list(range(len(part)))
                order.shuffle(index)
                for start in range(0, len(index), self.batch_size):
                    batch = collate([tokenized[i] for i in index[start:start + self.batch_size]])
                    loss = self._loss(objective, model, {k: v.to(self.device) for k, v in batch.items()})
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        self.model, self.label_names, self.n_subset = model.eval(), names, len(chosen)
        return self

    def _loss(self, objective, model, batch) -> torch.Tensor:
        if self.loss == "ce":
            return objective(batch)[0]
        from ..models import model_inputs

        return gce_loss(model(**model_inputs(batch)).logits, batch["labels"], self.gce_q)

    def log_probs(self, data, rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        """``[n, C]`` float64 log-probabilities of ``rows`` of ``data`` (default: all), eval mode, no gradients."""
        from ..data import Collator, TokenizedData

        if self.model is None:
            raise RuntimeError("WeakLearner: not fitted yet; call fit(data) first")
        if tuple(data.label_names) != self.label_names:
            raise ValueError(f"WeakLearner.log_probs: the data's labels {data.label_names} are not those it was "
                             f"fitted on {self.label_names}")
        part = data if rows is None else data.subset(list(rows))
        tokenized = TokenizedData(part, self.tokenizer, self.max_length)
        collate = Collator(self.tokenizer)
        out = []
        with torch.inference_mode():
            for start in range(0, len(part), self.batch_size):
                batch = collate([tokenized[i] for i in range(start, min(start + self.batch_size, len(part)))])
                batch.pop("labels")
                logits = self.model(**{k: v.to(self.device) for k, v in batch.items()}).logits
                out.append(torch.log_softmax(logits.double(), -1).cpu())
        return torch.cat(out) if out else torch.zeros(0, len(self.label_names), dtype=torch.float64)

    def meta(self) -> Dict[str, Any]:
        return {"model": self.model_name, "subset": self.subset, "epochs": self.epochs, "layers": self.layers,
                "encoder_layers": self.total_layers, "lr": self.lr, "batch_size": self.batch_size,
                "max_length": self.max_length, "seed": self.seed, "loss": self.loss,
                "gce_q": self.gce_q if self.loss == "gce" else None}
