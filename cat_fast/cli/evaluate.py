"""``cat-fast eval``: score a checkpoint written by ``cat-fast train`` on evaluation files."""
from __future__ import annotations

import json
import os
import sys
from typing import Dict

from .common import CHECKPOINT_META, AtomicDir, CliError, EvalSet, get_device, parse_evals, setup_device, write_json
from .sources import Source

__all__ = ["evaluate"]


# ------------------------------------------------------------------------------------------------
# eval


def evaluate(args) -> Dict:
    from ..models.pretrained import load_classifier, resolve_model_dir
    from .train import check_max_length

    evals = parse_evals(args.eval)
    if args.out:
        AtomicDir.check(args.out, args.overwrite, inputs=[args.model] + [p for _, p in evals])
    directory = resolve_model_dir(args.model)
    meta = {}
    meta_path = os.path.join(directory, CHECKPOINT_META)
    if os.path.isfile(meta_path):
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            meta = {}
    if not (args.task or meta.get("task") or getattr(args, "text_column", None)):
        raise CliError(f"--task (or --text-column / --label-column) is required: {directory} has no "
                       f"{CHECKPOINT_META} naming its data")
    source = Source.from_args(args, meta)
    max_length = args.max_length or int(meta.get("max_length", 128))
    device = get_device(args.device)
    setup_device(device)
    if source.custom and not evals:
        raise CliError("--eval NAME=FILE is required for your own data (there is no built-in dev set)")
    model, tokenizer = load_classifier(directory, None)
    from ..analysis.masking import apply_saved_mask

    apply_saved_mask(model)  # a directory written by `cat-fast mask` runs masked
    label_names = tuple(source.labels or [model.config.id2label[i] for i in range(model.config.num_labels)])
    if model.config.num_labels != len(label_names):
        raise CliError(f"{directory}: the model has {model.config.num_labels} labels, the data has "
                       f"{len(label_names)} ({', '.join(label_names)})")
    data = [(name, source.read(path, labels=label_names)) for name, path in evals]
    pairs = any(d.text_pair is not None for _, d in data) or source.task == "nli"
    check_max_length(max_length, model, pairs=pairs, flag="--max-length" if args.max_length else
                     f"the checkpoint's max_length ({max_length})")
    model.to(device)
    sets = [EvalSet(name, d, tokenizer, max_length) for name, d in data]
    if not source.custom:  # a built-in task: its dev set always, as `cat-fast train` scores it
        sets.insert(0, EvalSet("dev", source.builtin_dev(), tokenizer, max_length, split_orig_edit=True))
    results = {}
    for s in sets:
        results.update(s.evaluate(model, args.eval_batch_size, device, args.bf16))
    metrics = {"task": source.name, "model": args.model, "max_length": max_length, "eval": results}
    if args.out:
        atomic = AtomicDir(args.out, args.overwrite)
        with atomic as tmp:
            write_json(os.path.join(tmp, "metrics.json"), metrics)
            atomic.commit()
    else:
        sys.stdout.write(json.dumps(metrics, indent=2) + "\n")
    return metrics
