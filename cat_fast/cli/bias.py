"""``cat-fast bias fit``: a bias model's predictions for the training examples, for the bias-model methods
(``cat-fast train --method poe|reweight|reweight-inverse|learned-mixin|conf-reg --bias DIR``).

``--kind overlap``: word-overlap features and a logistic regression fitted on the training split (text pairs:
NLI); ``--kind column``: a classifier trained on one column (``--model DIR``, ``--column text_pair`` for a
hypothesis-only bias). Writes ``DIR/bias.jsonl`` (per-example log-probabilities keyed by example id, with the
fingerprint of each example's texts and label that ``train --bias`` checks, `cat_fast.bias.save_bias`) and
``DIR/bias_meta.json``, atomically.
"""
from __future__ import annotations

import os
import sys
from typing import Dict

from .common import AtomicDir, CliError, get_device, write_json
from .sources import Source

__all__ = ["fit", "BIAS_FILE", "resolve"]

BIAS_FILE = "bias.jsonl"


def resolve(path: str) -> str:
    """A bias file, or the directory `cat-fast bias fit` wrote."""
    return os.path.join(path, BIAS_FILE) if os.path.isdir(path) else path


def fit(args) -> Dict:
    import torch

    from ..bias import ColumnBias, OverlapBias, save_bias
    from ..data import require_classes

    source = Source.from_args(args)
    AtomicDir.check(args.out, args.overwrite, inputs=list(args.train or []) + [args.model or ""])
    train = source.read_train(args.train)
    labels = list(source.label_names(train))
    require_classes(train)
    if args.kind == "overlap":
        if train.text_pair is None:
            raise CliError("--kind overlap needs text pairs (premise and hypothesis: --task nli or --text-pair-column)")
        model = OverlapBias(C=args.C).fit(train, labels)
        log_probs, meta = model.log_probs(train), model.meta()
    else:
        if not args.model:
            raise CliError("--kind column needs --model DIR: a classifier trained on that column (cat-fast train "
                           "--text-column ...)")
        try:
            model = ColumnBias(args.model, column=args.column, label_names=labels)
            log_probs = model.log_probs(train, batch_size=args.batch_size, device=get_device(args.device))
        except ValueError as error:
            raise CliError(f"--kind column: {error}") from error
        meta = {"kind": "column", "model": args.model, "column": args.column}
    accuracy = float((log_probs.argmax(-1) == torch.tensor(train.labels)).float().mean())
    meta = dict(meta, task=source.name, n=len(train), train_accuracy=accuracy)
    atomic = AtomicDir(args.out, args.overwrite)
    with atomic as tmp:
        save_bias(os.path.join(tmp, BIAS_FILE), train.ids, log_probs, labels, meta, data=train)
        write_json(os.path.join(tmp, "bias_meta.json"), meta)
        atomic.commit()
    sys.stderr.write(f"cat-fast: wrote {args.out} ({len(train)} examples; the bias model's training accuracy "
                     f"{accuracy:.4f})\n")
    return meta
