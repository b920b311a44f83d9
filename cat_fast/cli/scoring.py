"""Scoring for the ``cat-fast`` commands: tokenised batches, predictions, accuracy and confusion matrices, and the
evaluation sets (`EvalSet`) that ``train`` scores after each epoch and ``eval`` at the end."""
from __future__ import annotations

import collections
from typing import Dict, List, Optional, Sequence

__all__ = ["autocast", "to_device", "encode_batches", "predict_logits", "predict", "predict_probs", "accuracy",
           "confusion", "EvalSet"]


def autocast(device, bf16: bool):
    import contextlib

    import torch

    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def to_device(batch: Dict, device) -> Dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def encode_batches(tokenizer, data, rows: Sequence[int], batch_size: int, max_length: int, device) -> List[Dict]:
    """The examples `rows` of `data` (a CadData) as tokenised batches of `batch_size` on `device`, in that order:
    dicts of the model's inputs and ``labels``."""
    import torch

    out = []
    for start in range(0, len(rows), batch_size):
        idx = list(rows[start:start + batch_size])
        pair = [data.text_pair[i] for i in idx] if data.text_pair is not None else None
        enc = tokenizer([data.text[i] for i in idx], pair, padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        batch = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        batch["labels"] = torch.tensor([data.labels[i] for i in idx], device=device)
        out.append(batch)
    return out


def predict_logits(model, tokenized, batch_size: int, device, bf16: bool = False):
    """Logits [N, C] (float32, CPU) for every example of a TokenizedData, in its order (length-sorted batches,
    deterministic)."""
    import torch

    from ..data import Collator

    collate = Collator(tokenized.tokenizer)
    order = sorted(range(len(tokenized)), key=lambda i: (len(tokenized.features[i]["input_ids"]), i))
    out = torch.empty(len(tokenized), model.config.num_labels)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            batch = collate([tokenized[i] for i in idx])
            batch.pop("labels")
            with autocast(device, bf16):
                logits = model(**to_device(batch, device)).logits
            out[torch.tensor(idx)] = logits.float().cpu()
    model.train(was_training)
    return out


def predict(model, tokenized, batch_size: int, device, bf16: bool = False) -> List[int]:
    """Argmax predictions for every example of a TokenizedData."""
    return predict_logits(model, tokenized, batch_size, device, bf16).argmax(-1).tolist()


def predict_probs(model, tokenized, batch_size: int, device, bf16: bool = False):
    """Class probabilities [N, C] (float32, CPU) for every example of a TokenizedData, in its order."""
    return predict_logits(model, tokenized, batch_size, device, bf16).softmax(-1)


def accuracy(preds: Sequence[int], labels: Sequence[int], mask: Optional[Sequence[bool]] = None) -> Dict:
    pairs = [(p, y) for k, (p, y) in enumerate(zip(preds, labels)) if mask is None or mask[k]]
    n = len(pairs)
    return {"accuracy": (sum(p == y for p, y in pairs) / n) if n else float("nan"), "n": n}


def confusion(preds: Sequence[int], labels: Sequence[int], names: Sequence[str],
              mask: Optional[Sequence[bool]] = None) -> Dict:
    """``{"labels": names, "matrix": counts}``: ``matrix[gold][predicted]`` over the examples `mask` keeps."""
    matrix = [[0] * len(names) for _ in names]
    for k, (p, y) in enumerate(zip(preds, labels)):
        if mask is None or mask[k]:
            matrix[y][p] += 1
    return {"labels": list(names), "matrix": matrix}


# the share of a scored set's rows in one predicted class from which the model is said to have collapsed
COLLAPSED_SHARE = 0.99


class EvalSet:
    """One scored set: accuracy (HANS: by heuristic and label), with ``confusion=True`` also its confusion matrix
    (`confusion`, under the key ``confusion`` of each score)."""

    def __init__(self, name: str, data, tokenizer, max_length: int, split_orig_edit: bool = False,
                 confusion: bool = False):
        from ..data import TokenizedData

        self.name = name
        self.data = data
        self.tokenized = TokenizedData(data, tokenizer, max_length)
        self.split_orig_edit = split_orig_edit
        self.confusion = confusion
        self.collapsed = None  # the class the last scored model predicted for (nearly) every row, if any

    def _check_collapse(self, preds, names) -> None:
        """A model that puts (nearly) every row of a set holding several classes into one class has collapsed (a bias
        model that leaves nothing to learn, a learning rate too high): remembered for the command to say so."""
        self.collapsed = None
        if len(preds) >= 20 and len(set(self.data.labels)) > 1:
            top, count = collections.Counter(preds).most_common(1)[0]
            if count >= COLLAPSED_SHARE * len(preds):
                self.collapsed = names[top] if top < len(names) else str(top)

    def evaluate(self, model, batch_size, device, bf16) -> Dict[str, Dict]:
        preds = predict(model, self.tokenized, batch_size, device, bf16)
        names = [model.config.id2label[i] for i in range(model.config.num_labels)]
        # a model with unnamed labels: the data's names, in id order
        shown = list(self.data.label_names) if len(self.data.label_names) == len(names) else names
        self._check_collapse(preds, shown)
        if self.name == "hans" and hasattr(self.data, "heuristic"):  # accuracy by heuristic x label, as HANS reports
            from ..data import HANS_LABELS, score_hans

            out = score_hans(preds, self.data, names)
            if self.confusion:  # entailment / non-entailment, as HANS scores
                two = [int(names[p] != HANS_LABELS[0]) for p in preds]
                gold = [int(self.data.label_names[y] != HANS_LABELS[0]) for y in self.data.labels]
                out[self.name]["confusion"] = confusion(two, gold, HANS_LABELS)
            return out
        names = shown
        parts = [(self.name, None)]
        if self.split_orig_edit:
            parts += [(f"{self.name}_orig", self.data.is_orig), (f"{self.name}_edit", [not o for o in self.data.is_orig])]
        out = {}
        for key, mask in parts:
            out[key] = accuracy(preds, self.data.labels, mask)
            if self.confusion:
                out[key]["confusion"] = confusion(preds, self.data.labels, names, mask)
        return out
