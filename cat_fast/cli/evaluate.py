"""``cat-fast eval``: score a checkpoint written by ``cat-fast train`` on evaluation files.

The data's labels are matched to the model's ids by name (its config.json's id2label); a model with unnamed labels
(LABEL_0, LABEL_1, ...) takes them in id order (``--labels``, or the data's own order). A directory written by
``cat-fast mask`` runs masked; a checkpoint without a trained head is refused (`load_classifier`).

Beside the scores (``"eval"``, as ``cat-fast train`` writes them), the confusion matrix of every scored set:
``"confusion": {SET: {"labels": [...], "matrix": [[...]]}}`` (rows: the gold label, columns: the predicted one;
HANS: entailment / non-entailment), in metrics.json or the printed JSON.
`checkpoint_meta`, `read_labels` and `to_model_ids` are shared with ``cat-fast predict``.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Dict, Tuple

from .common import CHECKPOINT_META, AtomicDir, CliError, get_device, parse_evals, setup_device, write_json
from .scoring import EvalSet
from .sources import Source

__all__ = ["evaluate", "checkpoint_meta", "read_labels", "to_model_ids"]


# ------------------------------------------------------------------------------------------------
# eval


def checkpoint_meta(directory: str) -> Dict:
    """The checkpoint's ``cat_fast.json`` (its data, columns, labels and max_length), or ``{}``."""
    path = os.path.join(directory, CHECKPOINT_META)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def read_labels(directory: str, given, model_names: Tuple[str, ...]) -> Tuple[str, ...]:
    """The label names, in id order, that the evaluation files are read with: the model's own (the data's labels
    matched to its ids by name), or for a model with unnamed labels (LABEL_0, LABEL_1, ...) `given` in id order."""
    from ..models.pretrained import generic_labels

    if generic_labels(model_names):
        names = tuple(given or model_names)
        if len(names) != len(model_names):
            raise CliError(f"{directory}: the model has {len(model_names)} labels, the data has {len(names)} "
                           f"({', '.join(names)})")
        return names
    if given and sorted(given) != sorted(model_names):
        raise CliError(f"--labels {', '.join(given)}: {directory} has the labels {', '.join(model_names)} (its "
                       "config.json's id2label), and the data's labels are matched to them by name (only a model "
                       "with unnamed labels LABEL_0, LABEL_1, ... takes --labels in id order)")
    return model_names


def to_model_ids(data, model_names: Tuple[str, ...], directory: str):
    """`data` with its label ids turned into the model's, by name (a built-in task's fixed label order may differ from
    the model's); unchanged for a model with unnamed labels and for HANS (scored by name)."""
    from dataclasses import replace

    from ..data.core import TaskSpec
    from ..models.pretrained import generic_labels

    names = tuple(data.label_names)
    if getattr(data, "heuristic", None) is not None or names == model_names:
        return data
    if generic_labels(model_names) and len(names) == len(model_names):
        return data
    if sorted(names) != sorted(model_names):
        raise CliError(f"{directory}: the model's labels {', '.join(model_names)} are not the data's "
                       f"{', '.join(names)}")
    ids = [model_names.index(n) for n in names]
    spec = TaskSpec(data.spec.name, data.spec.label_column, data.spec.text_columns, model_names)
    return replace(data, labels=[ids[y] for y in data.labels], spec=spec)


def evaluate(args) -> Dict:
    from ..models.pretrained import label_names_of, load_classifier, resolve_model_dir
    from .train import check_max_length

    evals = parse_evals(args.eval)
    if args.out:
        AtomicDir.check(args.out, args.overwrite, inputs=[args.model] + [p for _, p in evals])
    directory = resolve_model_dir(args.model)
    meta = checkpoint_meta(directory)
    if not (args.task or meta.get("task") or getattr(args, "text_column", None) or evals):
        raise CliError(f"--task or --eval NAME=FILE is required: {directory} has no {CHECKPOINT_META} naming its "
                       f"data")
    source = Source.from_args(args, meta)
    max_length = args.max_length or int(meta.get("max_length", 128))
    device = get_device(args.device)
    setup_device(device)
    if source.custom and not evals:
        raise CliError("--eval NAME=FILE is required for your own data (there is no built-in dev set)")
    model, tokenizer = load_classifier(directory, None)  # a directory written by `cat-fast mask` runs masked
    model_names = label_names_of(model.config)
    label_names = read_labels(directory, source.labels, model_names)
    data = [(name, to_model_ids(source.read(path, labels=label_names), model_names, directory))
            for name, path in evals]
    pairs = any(d.text_pair is not None for _, d in data) or source.task == "nli"
    check_max_length(max_length, model, pairs=pairs, flag="--max-length" if args.max_length else
                     f"the checkpoint's max_length ({max_length})")
    model.to(device)
    sets = [EvalSet(name, d, tokenizer, max_length, confusion=True) for name, d in data]
    if not source.custom:  # a built-in task: its dev set always, as `cat-fast train` scores it
        dev = to_model_ids(source.builtin_dev(), model_names, directory)
        sets.insert(0, EvalSet("dev", dev, tokenizer, max_length, split_orig_edit=True, confusion=True))
    results, confusion = {}, {}
    for s in sets:
        scores = s.evaluate(model, args.eval_batch_size, device, args.bf16)
        for key, score in scores.items():  # "eval" keeps the schema of `cat-fast train`'s scores
            if "confusion" in score:
                confusion[key] = score.pop("confusion")
        results.update(scores)
    metrics = {"task": source.name, "model": args.model, "max_length": max_length, "eval": results,
               "confusion": confusion}
    if args.out:
        atomic = AtomicDir(args.out, args.overwrite)
        with atomic as tmp:
            write_json(os.path.join(tmp, "metrics.json"), metrics)
            atomic.commit()
    else:
        sys.stdout.write(json.dumps(metrics, indent=2) + "\n")
    return metrics
