"""``cat-fast eval``: score a checkpoint written by ``cat-fast train`` on evaluation files."""
from __future__ import annotations

import json
import os
import sys
from typing import Dict

from .common import CHECKPOINT_META, AtomicDir, CliError, eval_sets, get_device, parse_evals, setup_device, write_json

__all__ = ["evaluate"]


# ------------------------------------------------------------------------------------------------
# eval


def evaluate(args) -> Dict:
    from .. import data as D
    from ..models.pretrained import load_classifier, resolve_model_dir

    if args.out:
        AtomicDir.check(args.out, args.overwrite)
    evals = parse_evals(args.eval)
    directory = resolve_model_dir(args.model)
    meta = {}
    meta_path = os.path.join(directory, CHECKPOINT_META)
    if os.path.isfile(meta_path):
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            meta = {}
    task_name = args.task or meta.get("task")
    if not task_name:
        raise CliError(f"--task is required: {directory} has no {CHECKPOINT_META} naming its task")
    task = D.TASKS[task_name]
    max_length = args.max_length or int(meta.get("max_length", 128))
    device = get_device(args.device)
    setup_device(device)
    for _, path in evals:
        D.load_eval(task_name, path)
    model, tokenizer = load_classifier(directory, None)
    if model.config.num_labels != task.num_labels:
        raise CliError(f"{directory}: the model has {model.config.num_labels} labels, task {task_name} has "
                       f"{task.num_labels} ({', '.join(task.labels)})")
    model.to(device)
    sets = eval_sets(task_name, None, evals, tokenizer, max_length, include_dev=not evals)
    results = {}
    for s in sets:
        results.update(s.evaluate(model, args.eval_batch_size, device, args.bf16))
    metrics = {"task": task_name, "model": args.model, "max_length": max_length, "eval": results}
    if args.out:
        atomic = AtomicDir(args.out, args.overwrite)
        with atomic as tmp:
            write_json(os.path.join(tmp, "metrics.json"), metrics)
            atomic.commit()
    else:
        sys.stdout.write(json.dumps(metrics, indent=2) + "\n")
    return metrics
