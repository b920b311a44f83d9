"""``cat-fast train``: fine-tune a classifier with a registered objective (`cat_fast.objectives`) through the Hugging
Face Trainer (`cat_fast.integrations.ObjectiveTrainer`), on the built-in CAD data or the user's own files.

The batches of every epoch are drawn up front (`cat_fast.data.make_batches`, seeded by ``--seed`` + epoch; whole
counterfactual groups per batch for objectives that require pairs) and fed to the Trainer as one stream, so a
resumed run sees exactly the batches an uninterrupted one sees. Dev accuracy is measured at the end of each epoch.

Nothing here knows a method by name: the objective's options (flags, checks, help) come from its config, the data it
needs from its requirements (`train_data.HANDLERS`), the curves from its declarations. Its options are saved with
every output (``objective`` in metrics.json, the model directory's cat_fast.json and the checkpoint folder's run
record); ``--objective-config FILE|DIR`` repeats them (flags given on the command line win).

Under ``torchrun --nproc_per_node N`` (WORLD_SIZE > 1) the run is data-parallel through DistributedDataParallel
(`cat_fast.distributed`): ``--batch-size`` is per rank (a step sees N × --batch-size examples); each epoch's batches
(whole counterfactual groups) are dealt out in turn, rank r taking batches r, r + N, ... (the epoch's list padded
with its first batches to a multiple of N, so that every rank makes as many steps); rank 0 alone evaluates, logs and
writes metrics.json, the plot and the checkpoint; every rank resumes from the same checkpoint.

Modules beside it: `train_data` (data and requirements), `train_run` (the Trainer), `train_objective` (the
objective's options and its saved config).
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Dict

from .. import objectives
from .common import (
    AtomicDir,
    CliError,
    get_device,
    parse_evals,
    save_checkpoint,
    seed_everything,
    setup_device,
    write_json,
)
from .dev_eval import DevEvaluation
from .plot import plot
from .resume import CheckpointFolder, data_fingerprint
from .scoring import EvalSet
from .sources import Source
from .train_data import HANDLERS, Prepared, dev_half, read_dev, read_train
from .train_data import stream_parts as _stream_parts
from .train_objective import apply_objective_config, check_options, objective_record, pop_given
from .train_run import Scratch, finish, history_of, make_trainer, run_trainer, with_lora
from .trainer_args import resolve as resolve_trainer_args

__all__ = ["train", "build", "check_options", "dev_half", "fit_cat_graphs", "train_buckets", "check_max_length"]

MAX_CAT_GRAPHS = 64  # the most CAL-graph signatures the CLI lets an objective capture (batch sizes × lengths × layers)


def train_buckets(pad: str, max_length: int, device):
    """The padded lengths of the training batches (`data.length_buckets`), or None (each batch padded to its longest
    sequence): ``--pad buckets``, or ``auto`` on a GPU, where CUDA graphs are captured per batch shape."""
    from .. import data as D

    if pad == "buckets" or (pad == "auto" and device.type == "cuda"):
        return D.length_buckets(max_length)
    return None


def fit_cat_graphs(objective, epoch_batches, buckets) -> None:
    """Let an objective that captures graphs per (batch size, padded length, layer) (``graphs.max_graphs``,
    ``layers``) capture one for every signature the run will see, up to `MAX_CAT_GRAPHS`."""
    graphs = getattr(objective, "graphs", None)
    if buckets is None or graphs is None or not getattr(objective, "layers", None):
        return
    sizes = {len(b) for batches in epoch_batches for b in batches}
    graphs.max_graphs = max(graphs.max_graphs, min(MAX_CAT_GRAPHS, len(sizes) * len(buckets) * len(objective.layers)))


def _position_offset(model) -> int:
    """How many position ids a family uses before the first token's: RoBERTa-style embeddings (their position
    table has a padding index) start counting after the padding index."""
    import torch

    for name, module in model.named_modules():
        if name.endswith("position_embeddings") and isinstance(module, torch.nn.Embedding):
            return 0 if module.padding_idx is None else module.padding_idx + 1
    return 0


def check_max_length(max_length: int, model, pairs: bool, flag: str = "--max-length") -> None:
    """`max_length` must leave room for the special tokens and fit the model's position embeddings."""
    config = model.config
    low = 5 if pairs else 3  # [CLS] a [SEP] (b [SEP])
    limit = getattr(config, "max_position_embeddings", None)
    if limit:
        limit -= _position_offset(model)
    if max_length < low or (limit and max_length > limit):
        bound = f"at most {limit} (the model's positions)" if limit else "no upper bound"
        raise CliError(f"{flag} must be at least {low} (room for the special tokens{' of a text pair' if pairs else ''})"
                       f" and {bound}, got {max_length}")


def train(args) -> Dict:
    t_start = time.time()
    given = pop_given(args)
    entry = objectives.get(args.method)
    apply_objective_config(args, given)  # before the checks: its values are checked as the flags are
    source = Source.from_args(args)
    run = Prepared(args, entry, source)
    check_options(args)
    evals = parse_evals(args.eval, ("dev", "dev_orig", "dev_edit"))
    inputs = list(args.train or []) + ([args.dev] if args.dev else []) + [p for _, p in evals] + [args.model]
    run.out = AtomicDir.check(args.out or os.path.join("runs", f"{source.name}-{args.method}-seed{args.seed}"),
                              args.overwrite, inputs=inputs)
    run.folder = CheckpointFolder(run.out, args.save_steps > 0, args.resume, args.overwrite)
    from ..distributed import init_from_env

    try:
        run.device, run.rank, run.world = init_from_env(get_device(args.device))
    except ValueError as error:  # a setting of the environment torchrun gives every rank
        raise CliError(str(error)) from error
    setup_device(run.device)
    args.trainer_args = resolve_trainer_args(getattr(args, "trainer_args", None), args, run.device, run.world)
    seed_everything(args.seed)

    read_train(run)  # ---- data (validated before anything is written)
    run.objective_record = objective_record(entry, args)
    run.run_record = dict(vars(args), processes=run.world, data_fingerprint=data_fingerprint(run.train_data),
                          objective=run.objective_record)
    run.folder.check(run.run_record)  # the checkpoint folder is cat-fast's, and a --resume continues this very run
    read_dev(run, evals)
    build(run)
    return _train_and_write(run, t_start)


def build(run) -> None:
    """What a run trains with, once its data is read (`Prepared` after `read_train` / `read_dev`): the model and
    tokenised sets, the batches of every epoch and the objective, with the stream of batches it is fed
    (``run.parts``). `train` trains on them; `benchmarks/tools/cli_signatures.py` counts their graph signatures."""
    _load_model(run)
    _plan(run)
    _build_objective(run)


def _load_model(run) -> None:
    """The model (a fresh head, seeded), LoRA around it, what the requirements provide from it, the tokenised sets."""
    from .. import data as D
    from ..models.pretrained import load_classifier

    args = run.args
    run.attn = args.attn if args.attn != "auto" else ("eager" if run.entry.eager_attention else None)
    seed_everything(args.seed)  # the fresh head's initialisation depends on the seed only
    model, tokenizer = load_classifier(args.model, len(run.label_names), attn_implementation=run.attn,
                                       label_names=tuple(run.label_names), new_head=True, saved_mask="refuse")
    check_max_length(args.max_length, model, pairs=run.train_data.text_pair is not None)
    model.to(run.device)
    run.lora = with_lora(model, args) if args.lora else None  # the model keeps its class; LoRA layers inside
    for kind, handler in HANDLERS.items():
        if kind in run.kinds:
            handler.provide(run, model, tokenizer)
    run.model, run.tokenizer = model, tokenizer
    run.train_tok = D.TokenizedData(run.train_data, tokenizer, args.max_length)
    run.dev_set = None if run.dev_data is None else EvalSet(
        "dev", run.dev_data, tokenizer, args.max_length, split_orig_edit=args.dev is None and not run.source.custom)
    run.eval_sets = [EvalSet(name, d, tokenizer, args.max_length) for name, d in run.eval_data]


def _plan(run) -> None:
    """The batches of every epoch, the optimizer step each epoch ends at, the warm-ups."""
    from .. import data as D

    args, world, entry = run.args, run.world, run.entry
    sampler = D.make_batches(run.train_data, args.batch_size, keep_groups=run.use_pairs, shuffle=True, seed=args.seed)
    run.epoch_batches = [D.pad_batches(sampler.batches(e), world) for e in range(args.epochs)]
    run.ends, seen = [], 0  # the optimizer step at which each epoch ends (each rank takes one batch in `world`)
    for batches in run.epoch_batches:
        seen += len(batches) // world
        run.ends.append(math.ceil(seen / args.grad_accum))
    run.total_steps = run.ends[-1] if run.ends else 0
    if run.total_steps == 0:
        raise CliError("the training data gives no batch")
    run.active_from = args.warmup_epochs if entry.warmup else 0
    ends = run.ends
    run.warmup_steps = ends[run.active_from - 1] if 0 < run.active_from <= len(ends) else (
        run.total_steps if run.active_from > len(ends) else 0)
    run.lr_warm = args.warmup_steps if args.warmup_steps is not None else int(round(args.lr_warmup_ratio *
                                                                                      run.total_steps))
    if args.ddp_bucket_mb is not None and world == 1:
        sys.stderr.write("cat-fast: warning: --ddp-bucket-mb has no effect in one process (it sizes "
                         "DistributedDataParallel's buckets under torchrun)\n")
    if entry.warmup and run.active_from >= args.epochs:
        sys.stderr.write(f"cat-fast: warning: --warmup-epochs {args.warmup_epochs} >= --epochs {args.epochs}: "
                         f"{run.method} trains with plain ERM only\n")


def _build_objective(run) -> None:
    """The objective: the registry's preset, then its options from the command line, then what the run provides
    (warm-up steps, the requirements' arguments, its settings under DDP)."""
    args, entry = run.args, run.entry
    extra = {"warmup_steps": run.warmup_steps} if entry.warmup else {}
    if run.world > 1:
        extra.update(entry.cls.distributed_preset)
    extra.update(run.kwargs)
    try:
        run.objective = objectives.build(run.method, run.model, options=vars(args), **extra)
    except (ValueError, TypeError) as error:
        raise CliError(f"--method {run.method}: {error}") from error
    step_graphs = getattr(args, "step_graphs", None)  # None: on a GPU where the run allows it (ObjectiveTrainer)
    if step_graphs and args.grad_accum != 1:
        raise CliError(f"--step-graphs: --grad-accum must be 1 (one captured step per optimizer step), got "
                       f"{args.grad_accum}")
    partners = (lambda epoch: run.train_data.choose_partners(args.seed + epoch)) if run.use_pairs else None
    buckets = train_buckets(args.pad, args.max_length, run.device)
    run.parts = _stream_parts(run.train_tok, run.tokenizer, run.epoch_batches, partners, run.rows, buckets)
    fit_cat_graphs(run.objective, run.epoch_batches, buckets)


def _fit(run, tmp):
    """Train (rank 0 opens the checkpoint folder first); the trainer and its dev evaluation."""
    args = run.args
    if run.rank == 0:
        run.folder.open(run.run_record)
    trainer = make_trainer(args, run.model, run.objective, run.parts, run.folder.path if args.save_steps > 0 else tmp,
                           run, run.world, run.device)
    dev_set = run.dev_set
    dev_eval = DevEvaluation(
        run.ends, lambda: None if dev_set is None else dev_set.evaluate(run.model, args.eval_batch_size, run.device,
                                                                        args.bf16),
        lambda logs: setattr(trainer, "pending", {**trainer.pending, **logs}), run.model, eval_steps=args.eval_steps,
        keep_best=args.keep_best, patience=args.early_stopping_patience, rank=run.rank, world=run.world)
    dev_eval.restore(run.folder.resume_from)
    trainer.add_callback(dev_eval)
    trainer.checkpoint_extras.append(dev_eval.save)
    if run.world > 1:
        seed_everything(args.seed + run.rank)  # each rank's own dropout stream (the Trainer seeded all alike)
    t0 = time.time()
    run_trainer(trainer, run.folder, run.method, run.rank)
    run.train_seconds = time.time() - t0
    return trainer, dev_eval


def _train_and_write(run, t_start) -> Dict:
    args = run.args
    atomic = AtomicDir(run.out, args.overwrite) if run.rank == 0 else Scratch()
    with atomic as tmp:
        trainer, dev_eval = _fit(run, tmp)
        if run.rank != 0:  # rank 0 evaluates and writes; the others are done
            steps = trainer.state.global_step
            trainer = dev_eval = None  # the DDP reducer and step graphs go before the process group (see finish)
            finish(run.world)
            return {"rank": run.rank, "steps": steps, "train_seconds": round(run.train_seconds, 3)}
        metrics = _write_outputs(run, trainer, dev_eval, tmp, t_start)
        atomic.commit()
    trainer = dev_eval = None  # (dev_eval's logging closure holds the trainer)
    finish(run.world)
    if args.keep_checkpoints and run.folder.has_checkpoint():
        sys.stderr.write(f"cat-fast: checkpoints kept in {run.folder.path} (--keep-checkpoints)\n")
    else:
        run.folder.close()  # the run is complete: its checkpoints are not needed
    scores = ", ".join(f"{name} accuracy {r['accuracy']:.4f}" for name, r in metrics["eval"].items()
                       if "/" not in name and isinstance(r, dict) and "accuracy" in r)
    sys.stderr.write(f"cat-fast: wrote {run.out} ({scores or 'no dev or --eval set scored'})\n")
    for s in ([run.dev_set] if run.dev_set is not None else []) + list(run.eval_sets):
        if s.collapsed is not None:
            sys.stderr.write(f"cat-fast: warning: the trained model predicts {s.collapsed!r} for nearly every "
                             f"{s.name} example (a collapsed run: with a bias-model method, a bias model that is "
                             f"right and confident on most rows leaves nothing to learn; else try a lower --lr)\n")
    return metrics


def _scores(run, trainer, dev_eval):
    """The history per epoch, the final scores and the best evaluation."""
    args, model = run.args, run.model
    if trainer.pending:
        trainer.state.log_history.append({**trainer.pending, "step": trainer.state.global_step})
    logs, final = trainer.state.log_history, trainer.state.global_step
    ran = [e for e in run.ends if e <= final] + ([final] if dev_eval.stopped_at and final not in run.ends else [])
    history = history_of(logs, ran, run.active_from, run.method)
    results = dict(history[-1]["eval"]) if history and history[-1]["eval"] else {}
    best = None
    if dev_eval.best is not None:
        best = {"step": dev_eval.best_step, "dev_accuracy": dev_eval.best, "kept": bool(args.keep_best),
                "early_stopped_at": dev_eval.stopped_at}
    if args.keep_best and dev_eval.load_best():  # the final model is the best one: its scores
        results = run.dev_set.evaluate(model, args.eval_batch_size, run.device, args.bf16)
    for s in run.eval_sets:
        results.update(s.evaluate(model, args.eval_batch_size, run.device, args.bf16))
    return logs, history, results, best


def _write_outputs(run, trainer, dev_eval, tmp, t_start) -> Dict:
    """The checkpoint (with the objective's config in cat_fast.json), curves.png and metrics.json into `tmp`."""
    args, data, source = run.args, run.train_data, run.source
    logs, history, results, best = _scores(run, trainer, dev_eval)
    config = {k: v for k, v in vars(args).items() if k not in ("command",)}
    config.update(data=run.data_mode, out=run.out, attn=run.attn or "default", device=str(run.device),
                  task=source.name, processes=run.world, global_batch_size=args.batch_size * run.world,
                  step_graphs=bool(trainer.step_graphs), **run.record)
    if not args.no_checkpoint:
        meta = dict(source.meta(data), method=run.method, max_length=args.max_length, base_model=args.model,
                    seed=args.seed, objective=run.objective_record)
        model = run.model
        if run.lora is not None:  # saved merged: a plain model of the base's class
            used = run.lora.peft_config["default"]
            meta["lora"] = {"r": args.lora, "alpha": used.lora_alpha, "dropout": args.lora_dropout,
                            "target_modules": sorted(used.target_modules), "merged": True}
            model = run.lora.merge_and_unload()
        save_checkpoint(tmp, model, run.tokenizer, meta)
    metrics = {
        "method": run.method, "task": source.name, "model": args.model, "seed": args.seed, "eval": results,
        "train_seconds": round(run.train_seconds, 3), "steps": trainer.state.global_step,
        "total_seconds": round(time.time() - t_start, 3), "warmup_steps": run.warmup_steps,
        "labels": list(run.label_names),
        "data": {"mode": run.data_mode, "n_train": len(data), "n_orig": data.n_orig, "n_edits": len(data) - data.n_orig,
                 "classes": data.class_counts(), "groups": len(data.groups), "skipped": getattr(data, "skipped", 0),
                 **run.shift},
        "history": history,
        "evaluations": [{"step": h.get("step"), "dev_accuracy": h["eval/dev/accuracy"]} for h in logs
                        if "eval/dev/accuracy" in h],
        "best": best,
        "config": config,
        "objective": run.objective_record,
    }
    plot(os.path.join(tmp, "curves.png"), logs, history, run.warmup_steps,
         f"{source.name} / {run.method} / {os.path.basename(str(args.model).rstrip('/'))} / seed {args.seed}",
         run.entry.cls.curves)
    metrics["total_seconds"] = round(time.time() - t_start, 3)
    write_json(os.path.join(tmp, "metrics.json"), metrics)
    return metrics
