"""Counterfactually-augmented data (CAD) and users' own data: reading, validation, pairs, few-shot sampling, batching.

The shipped CAD files (Kaushik et al., ICLR 2020; Apache-2.0) live in ``cat_fast/data/cad/``;
:func:`builtin_path` finds them. See :mod:`cat_fast.data.core` for formats and pairing rules,
:mod:`cat_fast.data.tables` for users' own files (:func:`load_table`: CSV, TSV, JSON Lines, Hugging Face dataset
folders; any label set, optional groups of counterfactuals) and :mod:`cat_fast.data.batching` for how batches keep
pairs together (:class:`GroupBatchSampler`, :func:`group_batches`).
:mod:`cat_fast.data.hans` ships a HANS-style NLI challenge set (:func:`load_hans`) and scores models on it (:func:`score_hans`).

Typical use::

    from cat_fast import data
    train = data.load_train("nli")                      # built-in originals + 4 edits each
    train = data.few_shot(train, per_class=32, seed=0)  # 32 originals per class (+ their edits)
    ds = data.TokenizedData(train, tokenizer, max_length=128)
    sampler = data.make_batches(train, batch_size=15, keep_groups=True, seed=0)
    collate = data.Collator(tokenizer, partner=train.choose_partners(seed=0))
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=collate)
    for batch in loader:
        pairs = batch.pop("pairs")                      # int64 [B], -1 = no counterfactual in batch
        loss, info = gs(batch, pairs)

Your own data instead of the built-in files::

    train = data.load_table("train.csv", text_column="text", label_column="label", group_column="pair_id")
"""
from . import batching, cad_readers, core, sampling, tables, text_files
from .batching import *  # noqa: F401,F403  (the public names are listed in each module's __all__)
from .cad_readers import *  # noqa: F401,F403
from .core import *  # noqa: F401,F403
from .hans import *  # noqa: F401,F403
from .hans import __all__ as _hans_all
from .sampling import *  # noqa: F401,F403
from .tables import *  # noqa: F401,F403
from .text_files import *  # noqa: F401,F403

__all__ = core.__all__ + text_files.__all__ + cad_readers.__all__ + sampling.__all__ + batching.__all__ + tables.__all__
__all__ += _hans_all
