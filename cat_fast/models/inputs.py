"""What the model's forward takes: the batch without targets, the sync-free attention mask, logits of an output."""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import nn

from .structure import uncompiled

__all__ = ["TARGET_KEYS", "MODEL_TARGETS", "declare_batch_keys", "metadata_keys", "model_inputs", "sync_free_inputs",
           "logits_of", "logits_close", "eval_no_grad"]


MODEL_TARGETS = ("labels", "start_positions", "end_positions")  # the targets the models' own losses read


class _BatchKeys(Sequence):
    """The batch keys never passed to the model's forward: `MODEL_TARGETS` and the columns that objectives declare
    (`declare_batch_keys`, from their requirements). Live: a key declared later is in it."""

    def __init__(self):
        self._keys = dict.fromkeys(MODEL_TARGETS)

    def __getitem__(self, i):
        return tuple(self._keys)[i]

    def __len__(self):
        return len(self._keys)

    def __contains__(self, key):
        return key in self._keys

    def __iter__(self):
        return iter(tuple(self._keys))

    def __repr__(self):
        return repr(tuple(self._keys))


TARGET_KEYS = _BatchKeys()


def declare_batch_keys(*keys: str) -> None:
    """Add batch columns that are not model inputs (an objective's requirements: `cat_fast.objectives.Requirement`)."""
    for key in keys:
        if not isinstance(key, str) or not key:
            raise TypeError(f"batch key: expected a non-empty string, got {key!r}")
        TARGET_KEYS._keys.setdefault(key)


def metadata_keys() -> tuple:
    """The declared batch columns besides `MODEL_TARGETS` (pairs, bias-model columns, ...)."""
    return tuple(k for k in TARGET_KEYS if k not in MODEL_TARGETS)


def model_inputs(batch) -> dict:
    """The batch without targets and cat_fast metadata: what the model's forward takes."""
    return {k: v for k, v in batch.items() if k not in TARGET_KEYS}


_MASK_4D: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def _padding_mask_4d(mask):
    """The mask Hugging Face's SDPA path builds from a 2-D padding mask when the batch has padding: bool
    [B, 1, T, T], True where a query may attend a key."""
    T = mask.shape[-1]
    return mask.bool()[:, None, None, :] & torch.ones(T, 1, dtype=torch.bool, device=mask.device)


def logits_close(got, want, rtol, atol):
    """allclose of logits (a tensor, or a tuple for QA) in float32, `atol` scaled by 1 + max |want|."""
    pairs = list(zip(got, want)) if isinstance(want, tuple) else [(got, want)]
    return all(torch.allclose(g.float(), w.float(), rtol=rtol, atol=atol * (1.0 + float(w.abs().max())))
               for g, w in pairs)


def _mask_4d_ok(model, inputs) -> bool:
    """Whether `model` computes the same with `_padding_mask_4d(mask)` as with the 2-D mask; decided once per model
    (two eval-mode, no-grad forwards of this batch with one padded position added, one host synchronisation; the
    module's own forward, `uncompiled`)."""
    known = _MASK_4D.get(model)
    if known is None:
        probe = inputs["attention_mask"].clone()
        probe[0, -1] = 0  # a padded position, so that the model's own forward builds and uses its mask
        try:
            with eval_no_grad(model, probe.device.type), uncompiled(model) as module:
                want = logits_of(module(**dict(inputs, attention_mask=probe)))
                got = logits_of(module(**dict(inputs, attention_mask=_padding_mask_4d(probe))))
            known = logits_close(got, want, rtol=1e-4, atol=1e-5)
        except Exception:  # noqa: BLE001 - a model that cannot take the 4-D mask keeps its own
            known = False
        _MASK_4D[model] = known
    return known


def sync_free_inputs(model, inputs: dict) -> dict:
    """`inputs` with a 2-D attention mask replaced by the 4-D mask the model's SDPA attention builds from it, when
    the model computes the same with it (checked once per model: `_mask_4d_ok`).

    Hugging Face's SDPA mask code asks whether the 2-D mask has any padding (``padding_mask.all()``, to drop the
    mask and use the unmasked kernel when there is none): a host synchronisation in every forward of a batch
    that carries an attention mask. Given the 4-D mask, the model uses it as is: no synchronisation, so the host
    can queue the step ahead of the GPU. The values are those of the model's own mask (the same tensor when the
    batch has padding); a batch without padding then runs the masked kernel instead of the unmasked one (the same
    values up to rounding). Models with eager attention, or that use the mask elsewhere (DeBERTa-v2's
    embeddings), keep their 2-D mask."""
    mask = inputs.get("attention_mask")
    if (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] < 2 or mask.is_floating_point()
            or getattr(getattr(model, "config", None), "_attn_implementation", None) != "sdpa"
            or not _mask_4d_ok(model, inputs)):
        return inputs
    return dict(inputs, attention_mask=_padding_mask_4d(mask))


def logits_of(outputs):
    """`logits` of a classification output; `(start_logits, end_logits)` of a QA output."""
    if hasattr(outputs, "start_logits"):
        return outputs.start_logits, outputs.end_logits
    if hasattr(outputs, "logits"):
        return outputs.logits
    return outputs[0]


@contextmanager
def eval_no_grad(model, device_type):
    """Eval mode, no autograd, no autocast; the modules' training flags restored on exit."""
    modes = [(mod, mod.training) for mod in model.modules()]
    try:
        model.eval()
        with torch.no_grad(), torch.autocast(device_type, enabled=False):
            yield
    finally:
        for mod, mode in modes:
            mod.training = mode
