"""A one-column bias model: a classifier trained by cat_fast on one text column (e.g. hypothesis-only NLI), scored
on that column of each example (docs/METHODS.md §4: the bias model's log-probabilities ``b``).

Typical use (train the classifier first, e.g. ``cat-fast train --train train.csv --text-column hypothesis
--label-column label ... --out runs/hyp_only``)::

    cb = ColumnBias("runs/hyp_only", column="text_pair")        # the hypothesis of an NLI CadData
    b = cb.log_probs(train, batch_size=64, device="cpu")       # [N, C] float32, columns in train.label_names order

``column``: ``"text"`` or ``"text_pair"``, or the data's own column name for one of them (``"sentence2"``). Texts
are tokenised alone (no pair), truncated to ``max_length`` (default: the checkpoint's ``cat_fast.json``, else 128),
padded per batch, and run in eval mode without gradients. The model's labels (its ``id2label``, or
``label_names=``) must be the data's label set; their order may differ, columns are permuted to the data's order.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence, Tuple

import torch

__all__ = ["ColumnBias"]

_CHECKPOINT_META = "cat_fast.json"  # written into a checkpoint by `cat-fast train`
_COLUMNS = ("text", "text_pair")


class ColumnBias:
    """Log-probabilities of a trained sequence classifier (``model_dir``, loaded by
    :func:`cat_fast.models.pretrained.load_classifier`) on one column of the data."""

    def __init__(self, model_dir: str, column: str = "text_pair", max_length: Optional[int] = None,
                 label_names: Optional[Sequence[str]] = None):
        from ..models.pretrained import load_classifier, resolve_model_dir

        if not isinstance(column, str) or not column:
            raise ValueError(f"ColumnBias: column={column!r}; expected 'text', 'text_pair' or a text column's name")
        self.model_dir = resolve_model_dir(os.fspath(model_dir))
        self.column = column
        meta = {}
        meta_path = os.path.join(self.model_dir, _CHECKPOINT_META)
        if os.path.isfile(meta_path):
            try:
                with open(meta_path, encoding="utf-8") as f:
                    meta = json.load(f)
            except (OSError, ValueError):
                meta = {}
        if max_length is None:
            max_length = int(meta.get("max_length", 128)) if isinstance(meta, dict) else 128
        if not (isinstance(max_length, int) and max_length >= 2):
            raise ValueError(f"ColumnBias: max_length={max_length!r}; expected an integer >= 2")
        self.model, self.tokenizer = load_classifier(self.model_dir, None)
        self.model.eval()
        limits = [max_length, getattr(self.model.config, "max_position_embeddings", None),
                  getattr(self.tokenizer, "model_max_length", None)]
        self.max_length = min(v for v in limits if isinstance(v, int) and 0 < v < 10**6)
        k = self.model.config.num_labels
        if label_names is None:
            id2label = self.model.config.id2label
            label_names = [str(id2label.get(i, id2label.get(str(i), i))) for i in range(k)]
        label_names = tuple(label_names)
        if len(label_names) != k or len(set(label_names)) != k:
            raise ValueError(f"ColumnBias: {self.model_dir}: label_names {list(label_names)}; expected {k} distinct "
                             f"names (the model has {k} labels)")
        self.label_names: Tuple[str, ...] = label_names

    def _texts(self, data):
        cols = tuple(getattr(getattr(data, "spec", None), "text_columns", ()))
        names = dict(zip(cols, _COLUMNS))
        which = self.column if self.column in _COLUMNS else names.get(self.column)
        if which is None:
            raise ValueError(f"ColumnBias: column {self.column!r} is not one of text, text_pair"
                             f"{''.join(', ' + c for c in cols)}; expected one of those")
        texts = getattr(data, which)
        if texts is None:
            raise ValueError(f"ColumnBias: column {self.column!r}: the data has no text pairs (its text column"
                             f"{'s are ' + ', '.join(cols) if len(cols) > 1 else ' is ' + (cols[0] if cols else 'text')})")
        return texts

    def _order(self, data):
        """Model class index of each of the data's labels (its columns in data.label_names order)."""
        want = tuple(data.label_names)
        if set(want) != set(self.label_names) or len(want) != len(self.label_names):
            raise ValueError(f"ColumnBias: {self.model_dir}: the model's labels ({', '.join(self.label_names)}) are "
                             f"not the data's ({', '.join(want)}); pass label_names= if the model's config does not "
                             f"name them")
        return [self.label_names.index(n) for n in want]

    def log_probs(self, data, batch_size: int = 64, device="cpu") -> torch.Tensor:
        """``[N, C]`` float32 log-probabilities (on the CPU) of the chosen column of ``data``, columns in
        ``data.label_names`` order; batches of ``batch_size``, no gradients, eval mode."""
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"ColumnBias.log_probs: batch_size={batch_size!r}; expected an integer >= 1")
        texts = list(self._texts(data))
        order = self._order(data)
        device = torch.device(device)
        self.model.to(device).eval()
        out = []
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                enc = self.tokenizer(texts[start:start + batch_size], truncation=True, max_length=self.max_length,
                                     padding=True, return_tensors="pt")
                logits = self.model(**{k: v.to(device) for k, v in enc.items()}).logits
                out.append(torch.log_softmax(logits.float(), -1)[:, order].cpu())
        if not out:
            return torch.zeros(0, len(order))
        return torch.cat(out)
