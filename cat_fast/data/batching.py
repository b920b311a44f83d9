"""Tokenisation, batching and collation of :class:`~cat_fast.data.core.CadData`.

* :class:`TokenizedData` tokenises once (no padding; ``max_length``, truncation; NLI as sentence pairs).
* :class:`GroupBatchSampler` yields batches of dataset indices that never split a group (an original
  and its edits), so every counterfactual partner is in the same batch. Group order is shuffled with
  ``random.Random(seed + epoch)``; groups are packed greedily in that order, a batch is closed when the
  next group would make it exceed ``batch_size`` (so with NLI groups of 5, ``batch_size`` 16 gives
  batches of 15). A group larger than ``batch_size`` becomes a batch of its own.
* :class:`Collator` pads to the longest sequence of the batch and returns the model's batch dict
  with ``labels`` (int64 [B]) and, when asked, ``pairs`` (int64 [B]): ``pairs[i]`` is the position in
  the batch of a counterfactual of sample i with a different label, -1 when none is in the batch.
  Pop ``pairs`` before calling the model.
* :class:`IntegerGroupIds` wraps any collate function so that ``pair_group`` ids of any hashable type (strings)
  reach it as integers (the Trainer classes wrap theirs).
* :func:`group_batches` is the same packing over a plain list of group ids (one per example, e.g. a
  ``datasets.Dataset`` column): the batches for one epoch, for a ``DataLoader(batch_sampler=...)`` or a
  ``Trainer`` that builds its own loader. ``group_batches(ids, B, seed=s, epoch=e)`` equals
  ``GroupBatchSampler(groups, B, seed=s).batches(e)`` with the groups in order of first appearance.

These work for any :class:`~cat_fast.data.core.CadData`, built-in CAD or user data (:func:`cat_fast.data.load_table`),
single texts or text pairs.
"""
from __future__ import annotations

import random
from typing import Dict, Hashable, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from .core import CadData

__all__ = ["TokenizedData", "GroupBatchSampler", "Collator", "IntegerGroupIds", "length_buckets", "make_batches", "group_batches", "pad_batches",
           "shard_batches"]


class TokenizedData(torch.utils.data.Dataset):
    """Token ids of every example of a :class:`CadData` (unpadded)."""

    def __init__(self, data: CadData, tokenizer, max_length: int = 128):
        self.data = data
        self.tokenizer = tokenizer
        self.max_length = max_length
        kw = dict(truncation=True, max_length=max_length, padding=False)
        if data.text_pair is not None:
            enc = tokenizer(data.text, data.text_pair, **kw)
        else:
            enc = tokenizer(data.text, **kw)
        self.keys = [k for k in ("input_ids", "token_type_ids", "attention_mask") if k in enc]
        self.features = [{k: enc[k][i] for k in self.keys} for i in range(len(data))]

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, i: int) -> Dict:
        item = dict(self.features[i])
        item["labels"] = self.data.labels[i]
        item["index"] = i
        return item


def _pack(groups: Sequence[List[int]], batch_size: int, shuffle: bool, rng_seed: int) -> List[List[int]]:
    """Groups (shuffled with ``random.Random(rng_seed)`` when ``shuffle``) packed greedily into batches."""
    order = list(range(len(groups)))
    if shuffle:
        random.Random(rng_seed).shuffle(order)
    out, cur = [], []
    for g in order:
        grp = groups[g]
        if cur and len(cur) + len(grp) > batch_size:
            out.append(cur)
            cur = []
        cur = cur + grp
        if len(cur) >= batch_size:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def group_batches(group_ids: Iterable[Hashable], batch_size: int, seed: int = 0, epoch: int = 0,
                  shuffle: bool = True) -> List[List[int]]:
    """Batches of positions ``0..len(group_ids)-1`` that never split a group, for one epoch.

    ``group_ids``: one id per example (any hashable: int, str; a list, a tensor or a ``datasets`` column);
    examples with equal ids form a group (every distinct value is one group, ``-1`` and ``None`` included).
    Groups are taken in order of first appearance, shuffled with ``random.Random(seed + epoch)`` when
    ``shuffle``, and packed greedily: a batch is closed when the next group would make it exceed ``batch_size``;
    a group larger than ``batch_size`` is a batch of its own. Same batches as :class:`GroupBatchSampler`.

    Example (Hugging Face ``datasets`` + ``torch``)::

        batches = group_batches(train_ds["pair_group"], 16, seed=0, epoch=epoch)
        loader = DataLoader(train_ds, batch_sampler=batches, collate_fn=collator)
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if hasattr(group_ids, "tolist"):  # tensors, numpy arrays
        group_ids = group_ids.tolist()
    groups: Dict[Hashable, List[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return _pack(list(groups.values()), batch_size, shuffle, seed + epoch)


class GroupBatchSampler(torch.utils.data.Sampler):
    """Batches of whole groups, shuffled per epoch by seed (call :meth:`set_epoch`)."""

    def __init__(self, groups: Sequence[Sequence[int]], batch_size: int, shuffle: bool = True, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.groups = [list(g) for g in groups]
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches(self, epoch: Optional[int] = None) -> List[List[int]]:
        epoch = self.epoch if epoch is None else epoch
        return _pack(self.groups, self.batch_size, self.shuffle, self.seed + epoch)

    def __iter__(self) -> Iterator[List[int]]:
        return iter(self.batches())

    def __len__(self) -> int:
        return len(self.batches())


def make_batches(data: CadData, batch_size: int, keep_groups: bool, shuffle: bool = True, seed: int = 0) -> GroupBatchSampler:
    """A sampler over ``data``: whole groups per batch when ``keep_groups``, else single examples."""
    groups = data.groups if keep_groups else [[i] for i in range(len(data))]
    return GroupBatchSampler(groups, batch_size, shuffle=shuffle, seed=seed)


def pad_batches(batches: Sequence[List[int]], world: int) -> List[List[int]]:
    """`batches` followed by its first ones again, to a multiple of `world` batches (so that each of `world` ranks
    taking every world-th batch gets as many): the padding repeats a few whole batches, groups intact."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    batches = list(batches)
    if not batches:
        return batches
    missing = -len(batches) % world
    return batches + [batches[i % len(batches)] for i in range(missing)]


def shard_batches(batches: Sequence[List[int]], world: int, rank: int) -> List[List[int]]:
    """Rank `rank`'s share of `batches` under data parallelism: batches rank, rank + world, ... of
    ``pad_batches(batches, world)`` — whole batches, so a counterfactual group never spans two ranks, and every rank
    the same number (what accelerate's batch-sampler sharding deals out to the Trainer's ranks)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    return pad_batches(batches, world)[rank::world]


class IntegerGroupIds:
    """Wraps a collate function so that ``pair_group`` ids of any hashable type (strings, tuples) reach it as
    integers: each batch's ids are numbered in order of first appearance, which keeps equal ids equal within the
    batch (all that `pair_by_group` compares). Items with integer ids pass through as they are. Other attributes
    are the wrapped collator's (e.g. ``tokenizer``)."""

    def __init__(self, collate_fn, key: str = "pair_group"):
        self.collate_fn = collate_fn
        self.key = key

    def __getattr__(self, name):
        if name in ("collate_fn", "key"):  # not set yet (unpickling): no recursion into the wrapped collator
            raise AttributeError(name)
        return getattr(self.collate_fn, name)

    def __call__(self, items):
        key = self.key
        ids = [it[key] for it in items if isinstance(it, dict) and key in it]
        if ids and not all(isinstance(g, int) or (isinstance(g, torch.Tensor) and not g.is_floating_point())
                           for g in ids):
            codes: Dict[Hashable, int] = {}
            items = [{**it, key: codes.setdefault(it[key], len(codes))} if key in it else it for it in items]
        return self.collate_fn(items)


def length_buckets(max_length: int, smallest: int = 32) -> Tuple[int, ...]:
    """Padded lengths for batches of sequences truncated at `max_length`: 32, 64, 96, 128, then steps of half the
    previous power of two (192, 256, 384, 512, 768, ...), below `max_length`, and `max_length` itself. A run sees a
    handful of batch shapes (CUDA graphs are captured per shape), and a batch is padded by at most half its longest
    sequence; 128 → (32, 64, 96, 128), 256 → (32, 64, 96, 128, 192, 256)."""
    if int(max_length) != max_length or max_length < 1:
        raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
    if int(smallest) != smallest or smallest < 1:
        raise ValueError(f"smallest must be a positive integer, got {smallest!r}")
    out, n = [], int(smallest)
    while n < max_length:
        out.append(n)
        step = max(int(smallest), 1 << (n.bit_length() - 2)) if n >= 4 * smallest else int(smallest)
        n += step
    return tuple(out) + (int(max_length),)


class Collator:
    """Pads a list of :class:`TokenizedData` items into the model's batch dict (+ ``labels``, + ``pairs``).

    ``partner``: one partner dataset index per example (see ``CadData.choose_partners``); when given,
    the batch gets ``pairs``. ``buckets``: increasing lengths (`length_buckets`); each batch is padded to the
    smallest one that holds its longest sequence (to the longest when none does), so that the batches take a few
    shapes. Padding is masked: the logits change only by floating-point rounding.
    """

    def __init__(self, tokenizer, partner: Optional[Sequence[int]] = None, pad_to_multiple_of: Optional[int] = None,
                 buckets: Optional[Sequence[int]] = None):
        if buckets is not None:
            buckets = tuple(int(b) for b in buckets)
            if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
                raise ValueError(f"buckets: expected increasing positive lengths, got {buckets!r}")
            if pad_to_multiple_of is not None:
                raise ValueError("give buckets or pad_to_multiple_of, not both")
        self.tokenizer = tokenizer
        self.partner = partner
        self.pad_to_multiple_of = pad_to_multiple_of
        self.buckets = buckets

    def __call__(self, items: List[Dict]) -> Dict[str, torch.Tensor]:
        keys = [k for k in items[0] if k not in ("labels", "index")]
        padding = dict(padding=True, pad_to_multiple_of=self.pad_to_multiple_of)
        if self.buckets is not None:
            longest = max(len(it["input_ids"]) for it in items)
            fits = [b for b in self.buckets if b >= longest]
            if fits:
                padding = dict(padding="max_length", max_length=fits[0])
        batch = self.tokenizer.pad(
            [{k: it[k] for k in keys} for it in items],
            return_tensors="pt",
            **padding,
        )
        batch = dict(batch)
        batch["labels"] = torch.tensor([it["labels"] for it in items], dtype=torch.long)
        if self.partner is not None:
            pos = {it["index"]: b for b, it in enumerate(items)}
            batch["pairs"] = torch.tensor([pos.get(self.partner[it["index"]], -1) for it in items], dtype=torch.long)
        return batch
