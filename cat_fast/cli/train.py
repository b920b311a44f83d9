"""``cat-fast train``: fine-tune a classifier with a registered objective (`cat_fast.objectives`) through the Hugging
Face Trainer (`cat_fast.integrations.ObjectiveTrainer`), on the built-in CAD data or the user's own files.

The batches of every epoch are drawn up front (`cat_fast.data.make_batches`, seeded by ``--seed`` + epoch; whole
counterfactual groups per batch for objectives that need pairs) and fed to the Trainer as one stream, so a resumed
run sees exactly the batches an uninterrupted one sees. Dev accuracy is measured at the end of each epoch.

Under ``torchrun --nproc_per_node N`` (WORLD_SIZE > 1) the run is data-parallel through DistributedDataParallel
(`cat_fast.distributed`): ``--batch-size`` is per rank (a step sees N × --batch-size examples); each epoch's batches
(whole counterfactual groups) are dealt out in turn, rank r taking batches r, r + N, ... (the epoch's list padded
with its first batches to a multiple of N, so that every rank makes as many steps); rank 0 alone evaluates, logs and
writes metrics.json, the plot and the checkpoint; every rank resumes from the same checkpoint.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import os
import shutil
import sys
import time
from typing import Dict, List

from .. import objectives
from .common import (
    AtomicDir,
    CliError,
    EvalSet,
    TrainingFailed,
    encode_batches,
    get_device,
    parse_evals,
    plot,
    predict_probs,
    save_checkpoint,
    seed_everything,
    setup_device,
    write_json,
)
from .dev_eval import DevEvaluation
from .resume import CheckpointFolder, data_fingerprint
from .sources import Source

__all__ = ["train"]

FLOAT_OPTIONS = {  # option dest -> (flag, lowest allowed, open at the low end)
    "lr": ("--lr", 0.0, False), "weight_decay": ("--weight-decay", 0.0, False),
    "lr_warmup_ratio": ("--lr-warmup-ratio", 0.0, False), "max_grad_norm": ("--max-grad-norm", 0.0, False),
    "alpha": ("--alpha", 0.0, True), "beta": ("--beta", 0.0, True), "gamma": ("--gamma", None, False),
    "eta": ("--eta", None, False), "adv_lr": ("--adv-lr", 0.0, False), "crm_lr": ("--crm-lr", 0.0, False),
    "gs_weight": ("--gs-weight", 0.0, False), "entropy_weight": ("--entropy-weight", 0.0, False),
    "meta_lr": ("--meta-lr", 0.0, True), "clp_scale": ("--clp-scale", 0.0, True),
    "virtual_lr": ("--virtual-lr", 0.0, True), "lora_alpha": ("--lora-alpha", 0.0, True),
    "lora_dropout": ("--lora-dropout", 0.0, False),
}


DEV_SPLIT_SEED = 20261127  # fixed: the same two halves for every run, whatever --seed


def dev_half(dev, half: str):
    """Half of `dev` by counterfactual group (an original and its edits stay together): ``"tune"`` or ``"report"``,
    the groups shuffled with a fixed seed and cut in two, so that hyper-parameters chosen on one half are scored on
    the other (the equal tuning budget of docs/RESULTS-quality.md)."""
    import random

    groups = sorted(set(dev.group), key=str)
    random.Random(DEV_SPLIT_SEED).shuffle(groups)
    chosen = set(groups[: len(groups) // 2] if half == "tune" else groups[len(groups) // 2:])
    return dev.subset([i for i, g in enumerate(dev.group) if g in chosen])


MAX_CAT_GRAPHS = 64  # the most CAL-graph signatures the CLI lets CAT capture (batch sizes × lengths × layers)


def train_buckets(pad: str, max_length: int, device):
    """The padded lengths of the training batches (`data.length_buckets`), or None (each batch padded to its longest
    sequence): ``--pad buckets``, or ``auto`` on a GPU, where CAT's CUDA graphs are captured per batch shape."""
    from .. import data as D

    if pad == "buckets" or (pad == "auto" and device.type == "cuda"):
        return D.length_buckets(max_length)
    return None


def fit_cat_graphs(objective, epoch_batches, buckets) -> None:
    """Let CAT capture a CAL graph for every (batch size, padded length, mixing layer) the run will see, up to
    `MAX_CAT_GRAPHS` (its own default, 8, is less than 4 lengths × 2 layers × the odd last batch)."""
    graphs = getattr(objective, "graphs", None)
    if buckets is None or graphs is None or not getattr(objective, "layers", None):
        return
    sizes = {len(b) for batches in epoch_batches for b in batches}
    graphs.max_graphs = max(graphs.max_graphs, min(MAX_CAT_GRAPHS, len(sizes) * len(buckets) * len(objective.layers)))


def check_options(args) -> None:
    """Every number finite and in its range, the weight decay one that AdamW can apply, the logging integrations
    known and installed (one-line errors naming the option)."""
    for dest, (flag, low, open_low) in FLOAT_OPTIONS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if not math.isfinite(value) or (low is not None and (value < low or (open_low and value == low))):
            where = "" if low is None else (f" > {low:g}" if open_low else f" >= {low:g}")
            raise CliError(f"{flag} must be a finite number{where}, got {value}")
    from transformers.training_args import OptimizerNames

    names = [o.value for o in OptimizerNames]
    if args.optim not in names:
        raise CliError(f"--optim: expected one of the Trainer's optimizers ({', '.join(names[:6])}, ...), got "
                       f"{args.optim!r}")
    if getattr(args, "lora_dropout", 0.0) >= 1:
        raise CliError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    if args.lr_warmup_ratio > 1:
        raise CliError(f"--lr-warmup-ratio must be in [0, 1], got {args.lr_warmup_ratio}")
    if args.lr * args.weight_decay >= 1:  # AdamW's decoupled decay scales the weights by 1 - lr * weight_decay
        raise CliError(f"--weight-decay {args.weight_decay:g} with --lr {args.lr:g}: AdamW scales the weights by "
                       f"1 - lr x weight_decay = {1 - args.lr * args.weight_decay:g} each step; expected --lr x "
                       f"--weight-decay < 1")
    names = list(getattr(args, "report_to", None) or [])
    if names and names not in (["none"], ["all"]):
        from transformers.integrations import integration_utils as hf

        known = list(hf.INTEGRATION_TO_CALLBACK)
        unknown = [n for n in names if n not in known]
        if unknown:
            raise CliError(f"--report-to: {unknown[0]!r} is not a logging integration of the Hugging Face Trainer; "
                           f"expected 'none' or 'all' alone, or names among {', '.join(known)}")
        installed = hf.get_available_reporting_integrations()
        missing = [n for n in names if n not in installed]
        if missing:
            raise CliError(f"--report-to: {missing[0]} is not available (its package is not installed); installed "
                           f"integrations: {', '.join(installed) or 'none'}")


def check_max_length(max_length: int, model, pairs: bool, flag: str = "--max-length") -> None:
    """`max_length` must leave room for the special tokens and fit the model's position embeddings."""
    config = model.config
    low = 5 if pairs else 3  # [CLS] a [SEP] (b [SEP])
    limit = getattr(config, "max_position_embeddings", None)
    if limit and getattr(config, "model_type", "") in ("roberta", "xlm-roberta", "camembert", "longformer"):
        limit -= (getattr(config, "pad_token_id", 1) or 1) + 1  # their positions start after the padding index
    if max_length < low or (limit and max_length > limit):
        bound = f"at most {limit} (the model's positions)" if limit else "no upper bound"
        raise CliError(f"{flag} must be at least {low} (room for the special tokens{' of a text pair' if pairs else ''})"
                       f" and {bound}, got {max_length}")


def _report_skipped(name: str, data) -> None:
    skipped = getattr(data, "skipped", 0)
    if skipped:
        where = ", ".join(getattr(data, "skipped_where", [])[:3])
        sys.stderr.write(f"cat-fast: warning: {name}: skipped {skipped} row(s) with empty text ({where})\n")


def _stream_parts(tokenized, tokenizer, epoch_batches, partners, rows=None, buckets=None):
    """A dataset, a batch sampler and a collate function over the batches of every epoch in order (keys are
    (epoch, index); the collate function pairs each sample with its counterfactual chosen for that epoch, and pads
    each batch to a length of `buckets` when given)."""
    import torch

    from .. import data as D

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return len(tokenized)

        def __getitem__(self, key):
            epoch, i = key
            item = tokenized[i]
            item["epoch"] = epoch
            return item

    class Stream(torch.utils.data.Sampler):
        def __init__(self):
            self.batches = [[(e, i) for i in batch] for e, batches in enumerate(epoch_batches) for batch in batches]

        def __iter__(self):
            return iter(self.batches)

        def __len__(self):
            return len(self.batches)

    collators = {}

    def collate(items):
        epoch = items[0]["epoch"]
        if epoch not in collators:
            collators[epoch] = D.Collator(tokenizer, partner=partners(epoch) if partners else None, buckets=buckets)
        batch = collators[epoch]([{k: v for k, v in it.items() if k != "epoch"} for it in items])
        index = torch.tensor([it["index"] for it in items])
        for name, table in (rows or {}).items():  # per-example tensors: the bias model's, the teacher's
            batch[name] = table.index_select(0, index)
        return batch

    return Items(), Stream(), collate


def train(args) -> Dict:
    import torch
    from transformers import TrainingArguments
    from transformers.trainer_callback import ProgressCallback

    from .. import data as D
    from ..integrations.checkpoints import CheckpointError
    from ..integrations.trainer import NonFiniteLossError, ObjectiveTrainer, StepGraphsError
    from ..models.pretrained import load_classifier

    t_start = time.time()
    method = args.method
    entry = objectives.get(method)
    source = Source.from_args(args)
    data_mode = args.data or entry.data
    out = args.out or os.path.join("runs", f"{source.name}-{method}-seed{args.seed}")
    check_options(args)
    evals = parse_evals(args.eval, ("dev", "dev_orig", "dev_edit"))
    inputs = list(args.train or []) + ([args.dev] if args.dev else []) + [p for _, p in evals] + [args.model]
    out = AtomicDir.check(out, args.overwrite, inputs=inputs)
    saving = args.save_steps > 0
    folder = CheckpointFolder(out, saving, args.resume, args.overwrite)
    from ..distributed import init_from_env

    device, rank, world = init_from_env(get_device(args.device))
    setup_device(device)
    seed_everything(args.seed)

    # ---- data (validated before anything is written)
    train_data = source.read_train(args.train)
    _report_skipped("training data", train_data)
    if args.per_class:
        train_data = D.few_shot(train_data, args.per_class, seed=args.seed, with_edits=(data_mode == "orig+edits"))
    elif data_mode == "orig":
        train_data = train_data.originals()
    shift = {}
    try:
        if args.long_tail:
            label, _, fraction = args.long_tail.partition("=")
            try:
                fraction = float(fraction)
            except ValueError:
                raise CliError(f"--long-tail: expected LABEL=FRACTION, got {args.long_tail!r}") from None
            before = len(train_data)
            train_data = D.long_tail(train_data, label, fraction, seed=args.seed)
            shift["long_tail"] = {"label": label, "fraction": fraction, "removed": before - len(train_data)}
        clean = train_data  # the rows a bias model was fitted on: --label-noise changes labels only
        if args.label_noise:
            train_data, flipped = D.with_label_noise(train_data, args.label_noise, seed=args.seed)
            shift["label_noise"] = {"rate": args.label_noise, "flipped": len(flipped)}
    except D.DataError as error:
        raise CliError(str(error)) from error
    use_pairs = entry.cls.needs_pairs
    if use_pairs and not train_data.has_pairs:
        why = ("--data orig drops the edits" if data_mode == "orig" else
               "give --group-column for your own files; for CAD use a paired sentiment file (with batch_id) or NLI "
               "revised files after the originals")
        raise CliError(f"--method {method} needs counterfactual pairs in the training data, found none ({why})")
    label_names = source.label_names(train_data)
    D.require_classes(train_data)  # one class would build a one-label (regression) head
    record = dict(vars(args), processes=world, data_fingerprint=data_fingerprint(train_data))
    folder.check(record)  # the checkpoint folder is cat-fast's, and a --resume continues this very run
    rows = {}
    if getattr(entry.cls, "needs_bias", False):
        if not args.bias:
            raise CliError(f"--method {method} needs --bias FILE: a bias model's predictions for the training examples "
                           "(write them with `cat-fast bias fit`)")
        from ..bias import load_bias

        try:
            from .bias import resolve

            rows["bias"] = load_bias(resolve(args.bias), data=clean, label_names=list(label_names), extra="ignore")
        except (ValueError, OSError) as error:
            raise CliError(f"--bias {args.bias}: {error}") from error
    elif args.bias:
        raise CliError(f"--bias is for the bias-model methods (poe, reweight, learned-mixin, conf-reg), not {method}")
    dev_data = source.read(args.dev, labels=label_names) if args.dev else source.builtin_dev()
    meta_data = None
    needs_meta = getattr(entry.cls, "needs_meta", False)
    if args.meta_data and not needs_meta:
        raise CliError(f"--meta-data is for --method clp / clp-all, not {method}")
    if needs_meta and args.meta_data:
        meta_data = source.read(args.meta_data, labels=label_names)
    elif needs_meta or args.meta_holdout:  # the built-in draw: its groups leave the dev score
        if dev_data is None or not dev_data.has_pairs:
            raise CliError(f"--method {method} needs --meta-data FILE (a small balanced set; the built-in draw needs "
                           "a CAD dev set with edits)" if needs_meta else
                           "--meta-holdout needs the built-in CAD dev set (with edits)")
        from ..objectives.clp import metadata_from_cad

        try:
            drawn, dev_data = metadata_from_cad(dev_data, args.meta_per_class, seed=args.seed)
        except D.DataError as error:
            raise CliError(f"--meta-per-class {args.meta_per_class}: {error}") from error
        meta_data = drawn if needs_meta else None
    if args.dev_split != "all":
        if dev_data is None:
            raise CliError("--dev-split needs a dev set (the built-in CAD dev set, or --dev FILE)")
        dev_data = dev_half(dev_data, args.dev_split)
    if (args.keep_best or args.early_stopping_patience) and dev_data is None:
        raise CliError("--keep-best and --early-stopping-patience choose by dev accuracy: they need a dev set (--dev "
                       "FILE, or --task for the built-in one)")
    eval_data = [(name, source.read(path, labels=label_names)) for name, path in evals]
    for name, d in ([("dev", dev_data)] if dev_data is not None else []) + eval_data:
        _report_skipped(name, d)

    # ---- model
    attn = args.attn if args.attn != "auto" else ("eager" if entry.eager_attention else None)
    seed_everything(args.seed)  # the fresh head's initialisation depends on the seed only
    model, tokenizer = load_classifier(args.model, len(label_names), attn_implementation=attn,
                                       label_names=tuple(label_names), new_head=True, saved_mask="refuse")
    check_max_length(args.max_length, model, pairs=train_data.text_pair is not None)
    model.to(device)
    lora = with_lora(model, args) if args.lora else None  # the model keeps its class; LoRA layers inside
    if getattr(entry.cls, "needs_teacher", False):
        if not args.teacher:
            raise CliError(f"--method {method} needs --teacher DIR: a classifier trained on the same labels (e.g. by "
                           "`cat-fast train --method erm`) whose probabilities are the targets")
        teacher, _ = load_classifier(args.teacher, None)
        names = tuple(teacher.config.id2label[i] for i in range(teacher.config.num_labels))
        if names != tuple(label_names):
            raise CliError(f"--teacher {args.teacher}: its labels {list(names)} are not the data's {list(label_names)}")
        rows["teacher_probs"] = predict_probs(teacher.to(device), D.TokenizedData(train_data, tokenizer,
                                                                                   args.max_length),
                                              args.eval_batch_size, device, args.bf16)
        del teacher
    elif args.teacher:
        raise CliError(f"--teacher is for --method conf-reg, not {method}")

    train_tok = D.TokenizedData(train_data, tokenizer, args.max_length)
    dev_set = None if dev_data is None else EvalSet("dev", dev_data, tokenizer, args.max_length,
                                                     split_orig_edit=args.dev is None and not source.custom)
    eval_sets = [EvalSet(name, d, tokenizer, args.max_length) for name, d in eval_data]
    sampler = D.make_batches(train_data, args.batch_size, keep_groups=use_pairs, shuffle=True, seed=args.seed)
    epoch_batches = [D.pad_batches(sampler.batches(e), world) for e in range(args.epochs)]
    accum = args.grad_accum
    ends, seen = [], 0  # the optimizer step at which each epoch ends (each rank takes one batch in `world`)
    for batches in epoch_batches:
        seen += len(batches) // world
        ends.append(math.ceil(seen / accum))
    total_steps = ends[-1] if ends else 0
    if total_steps == 0:
        raise CliError("the training data gives no batch")
    cat_active_from = args.warmup_epochs if entry.warmup else 0
    warmup_steps = ends[cat_active_from - 1] if 0 < cat_active_from <= len(ends) else (
        total_steps if cat_active_from > len(ends) else 0)
    if args.ddp_bucket_mb is not None and world == 1:
        sys.stderr.write("cat-fast: warning: --ddp-bucket-mb has no effect in one process (it sizes "
                         "DistributedDataParallel's buckets under torchrun)\n")
    if entry.warmup and cat_active_from >= args.epochs:
        sys.stderr.write(f"cat-fast: warning: --warmup-epochs {args.warmup_epochs} >= --epochs {args.epochs}: "
                         f"{method} trains with plain ERM only\n")

    # the registry's preset, then the command line (a CPU generator seeded by --seed: λ, partners and layers are
    # reproducible on any device)
    extra = {"warmup_steps": warmup_steps} if entry.warmup else {}
    if world > 1 and "low_memory" in inspect.signature(entry.cls.__init__).parameters:
        extra["low_memory"] = False  # GS first-order's low-memory passes write .grad outside DDP's reducer
    if meta_data is not None:
        g = torch.Generator().manual_seed(args.seed)
        order = torch.randperm(len(meta_data), generator=g).tolist()
        meta_batches = encode_batches(tokenizer, meta_data, order, args.meta_batch_size, args.max_length, device)
        counts = torch.bincount(torch.tensor(train_data.labels), minlength=len(label_names))
        extra.update(meta_batches=meta_batches, class_prior=counts.tolist(), epoch_size=len(train_data))
    try:
        objective = objectives.build(method, model, options=vars(args), **extra)
    except (ValueError, TypeError) as error:
        raise CliError(f"--method {method}: {error}") from error

    step_graphs = getattr(args, "step_graphs", None)  # None: on a GPU where the run allows it (ObjectiveTrainer)
    if step_graphs and world > 1:
        raise CliError("--step-graphs: one process only (under torchrun the objective runs inside DDP's forward)")
    if step_graphs and args.grad_accum != 1:
        raise CliError(f"--step-graphs: --grad-accum must be 1 (one captured step per optimizer step), got "
                       f"{args.grad_accum}")
    # the optimizer (AdamW by default: no weight decay on biases and norms; the objective's own parameters too) and
    # the schedule are the Trainer's (ObjectiveTrainer.create_optimizer)
    lr_warm = args.warmup_steps if args.warmup_steps is not None else int(round(args.lr_warmup_ratio * total_steps))
    partners = (lambda epoch: train_data.choose_partners(args.seed + epoch)) if use_pairs else None
    buckets = train_buckets(args.pad, args.max_length, device)
    items, stream, collate = _stream_parts(train_tok, tokenizer, epoch_batches, partners, rows, buckets)
    fit_cat_graphs(objective, epoch_batches, buckets)

    config = {k: v for k, v in vars(args).items() if k not in ("command",)}
    config.update(data=data_mode, out=out, attn=attn or "default", device=str(device), task=source.name,
                  processes=world, global_batch_size=args.batch_size * world)
    if meta_data is not None or args.meta_holdout:  # the built-in draw leaves its groups out of the dev score
        config.update(meta_examples=None if meta_data is None else len(meta_data),
                      dev_examples=None if dev_data is None else len(dev_data))
    ckpt_meta = dict(source.meta(train_data), method=method, max_length=args.max_length, base_model=args.model,
                     seed=args.seed)
    if lora is not None:  # saved merged: a plain model of the base's class
        used = lora.peft_config["default"]
        ckpt_meta["lora"] = {"r": args.lora, "alpha": used.lora_alpha, "dropout": args.lora_dropout,
                             "target_modules": sorted(used.target_modules), "merged": True}

    class Run(ObjectiveTrainer):
        pending: Dict = {}  # the last epoch's dev accuracy, logged with that step's loss

        def get_train_dataloader(self):
            loader = torch.utils.data.DataLoader(items, batch_sampler=stream, collate_fn=collate, num_workers=0)
            return self.accelerator.prepare(loader)

        def log(self, logs, *a, **k):
            if self.pending and "loss" in logs:
                logs, self.pending = {**logs, **self.pending}, {}
            return super().log(logs, *a, **k)

    class Quiet(ProgressCallback):
        """The Trainer's progress bar, without printing every log line."""

        def on_log(self, targs, state, control, logs=None, **kw):
            if self.training_bar is not None and logs:
                shown = {k: f"{v:.4f}" for k, v in logs.items() if k in ("loss", "eval/dev/accuracy")}
                if shown:
                    self.training_bar.set_postfix(shown, refresh=False)

    atomic = AtomicDir(out, args.overwrite) if rank == 0 else _Scratch()
    with atomic as tmp:
        if rank == 0:
            folder.open(record)
        targs = TrainingArguments(
            output_dir=folder.path if saving else tmp, max_steps=total_steps, num_train_epochs=1,
            per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=accum,
            max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else 0.0,
            learning_rate=args.lr, weight_decay=args.weight_decay, lr_scheduler_type=args.lr_scheduler_type,
            warmup_steps=lr_warm, optim=args.optim,
            logging_steps=args.logging_steps, save_strategy="steps" if saving else "no",
            save_steps=args.save_steps if saving else 500, save_total_limit=args.save_total_limit,
            seed=args.seed, data_seed=args.seed, bf16=args.bf16, use_cpu=device.type == "cpu",
            report_to=args.report_to or "none", remove_unused_columns=False, dataloader_num_workers=0,
            disable_tqdm=False, log_level="error", save_only_model=False,
            ddp_find_unused_parameters=getattr(objective, "find_unused_parameters", False) if world > 1 else None,
            ddp_bucket_cap_mb=args.ddp_bucket_mb if world > 1 else None)
        with _step_graph_warnings():
            trainer = Run(model=model, args=targs, train_dataset=items, objective=objective, step_graphs=step_graphs)
        trainer.pending = {}
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(Quiet)
        dev_eval = DevEvaluation(
            ends, lambda: None if dev_set is None else dev_set.evaluate(model, args.eval_batch_size, device, args.bf16),
            lambda logs: setattr(trainer, "pending", {**trainer.pending, **logs}), model, eval_steps=args.eval_steps,
            keep_best=args.keep_best, patience=args.early_stopping_patience, rank=rank, world=world)
        dev_eval.restore(folder.resume_from)
        trainer.add_callback(dev_eval)
        trainer.checkpoint_extras.append(dev_eval.save)
        if world > 1:
            seed_everything(args.seed + rank)  # each rank's own dropout stream (the Trainer seeded all alike)
        t0 = time.time()
        try:
            with _step_graph_warnings():
                trainer.train(resume_from_checkpoint=folder.resume_from)
        except NonFiniteLossError as error:
            kept = folder.close(failed=True) if rank == 0 else None
            where = f" (the checkpoints it resumed from are kept in {kept})" if kept else ""
            raise TrainingFailed(f"{error}; no output written{where} (check the hyper-parameters, or lower --lr)"
                                 ) from error
        except StepGraphsError as error:
            if rank == 0:
                folder.close(failed=True)
            raise CliError(f"--step-graphs --method {method}: {error.reason}") from error
        except CheckpointError as error:
            raise CliError(f"--resume: {error}") from error
        except KeyboardInterrupt:
            if rank == 0 and folder.has_checkpoint():
                sys.stderr.write(f"cat-fast: checkpoints kept in {folder.path}: run the same command with --resume "
                                 "to continue\n")
            elif rank == 0:
                folder.close()
            raise
        train_seconds = time.time() - t0
        config["step_graphs"] = bool(trainer.step_graphs)  # as run: None (the default) resolved
        if rank != 0:  # rank 0 evaluates and writes; the others are done
            steps = trainer.state.global_step
            trainer = None  # the DDP reducer goes before the process group (see _finish)
            _finish(world)
            return {"rank": rank, "steps": steps, "train_seconds": round(train_seconds, 3)}
        if trainer.pending:
            trainer.state.log_history.append({**trainer.pending, "step": trainer.state.global_step})
        logs = trainer.state.log_history
        final = trainer.state.global_step
        ran = [e for e in ends if e <= final] + ([final] if dev_eval.stopped_at and final not in ends else [])
        history = _history(logs, ran, cat_active_from, method)
        results = dict(history[-1]["eval"]) if history and history[-1]["eval"] else {}
        best = None
        if dev_eval.best is not None:
            best = {"step": dev_eval.best_step, "dev_accuracy": dev_eval.best, "kept": bool(args.keep_best),
                    "early_stopped_at": dev_eval.stopped_at}
        if args.keep_best and dev_eval.load_best():  # the final model is the best one: its scores
            results = dev_set.evaluate(model, args.eval_batch_size, device, args.bf16)
        for s in eval_sets:
            results.update(s.evaluate(model, args.eval_batch_size, device, args.bf16))

        if not args.no_checkpoint:
            save_checkpoint(tmp, model if lora is None else lora.merge_and_unload(), tokenizer, ckpt_meta)
        metrics = {
            "method": method,
            "task": source.name,
            "model": args.model,
            "seed": args.seed,
            "eval": results,
            "train_seconds": round(train_seconds, 3),
            "steps": trainer.state.global_step,
            "total_seconds": round(time.time() - t_start, 3),
            "warmup_steps": warmup_steps,
            "labels": list(label_names),
            "data": {"mode": data_mode, "n_train": len(train_data), "n_orig": train_data.n_orig,
                     "n_edits": len(train_data) - train_data.n_orig, "classes": train_data.class_counts(),
                     "groups": len(train_data.groups), "skipped": getattr(train_data, "skipped", 0), **shift},
            "history": history,
            "evaluations": [{"step": h.get("step"), "dev_accuracy": h["eval/dev/accuracy"]} for h in logs
                            if "eval/dev/accuracy" in h],
            "best": best,
            "config": config,
        }
        plot(os.path.join(tmp, "curves.png"), logs, history, warmup_steps,
             f"{source.name} / {method} / {os.path.basename(str(args.model).rstrip('/'))} / seed {args.seed}")
        metrics["total_seconds"] = round(time.time() - t_start, 3)
        write_json(os.path.join(tmp, "metrics.json"), metrics)
        atomic.commit()
    trainer = None  # the DDP reducer goes before the process group (see _finish)
    _finish(world)
    if args.keep_checkpoints and folder.has_checkpoint():
        sys.stderr.write(f"cat-fast: checkpoints kept in {folder.path} (--keep-checkpoints)\n")
    else:
        folder.close()  # the run is complete: its checkpoints are not needed
    scores = ", ".join(f"{name} accuracy {r['accuracy']:.4f}" for name, r in results.items()
                       if "/" not in name and isinstance(r, dict) and "accuracy" in r)
    sys.stderr.write(f"cat-fast: wrote {out} ({scores or 'no dev or --eval set scored'})\n")
    return metrics


def with_lora(model, args):
    """``--lora R``: LoRA adapters of rank R (peft) on the target projections, trained with the classification
    head; everything else frozen. The model object stays the Hugging Face model (its projections wrapped in place),
    so the objectives drive it as before; the returned PeftModel merges the adapters into it for the checkpoint."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise CliError("--lora needs peft: pip install 'cat_fast[lora]'") from None
    from .. import models

    targets = [t for t in (args.lora_target_modules or "").split(",") if t] or None
    config = LoraConfig(r=args.lora, lora_alpha=args.lora_alpha if args.lora_alpha is not None else 2 * args.lora,
                        lora_dropout=args.lora_dropout, target_modules=targets)
    try:
        wrapped = get_peft_model(model, config)
    except ValueError as error:
        raise CliError(f"--lora-target-modules {args.lora_target_modules or '(peft default)'}: "
                       f"{' '.join(str(error).split())[:200]}") from error
    for p in models.structure(model).head.parameters():
        p.requires_grad_(True)
    return wrapped


@contextlib.contextmanager
def _step_graph_warnings():
    """The trainer's `StepGraphsWarning` as one ``cat-fast: warning:`` line naming the CLI's flag."""
    import warnings

    from ..integrations.trainer import StepGraphsWarning

    shown = warnings.showwarning

    def show(message, category, *args, **kwargs):
        if isinstance(message, StepGraphsWarning):
            sys.stderr.write(f"cat-fast: warning: the eager training step runs: {message.reason} (--no-step-graphs "
                             "silences this)\n")
        else:
            shown(message, category, *args, **kwargs)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


class _Scratch:
    """The output directory of a rank other than 0: a scratch directory that nothing is committed from."""

    def __enter__(self):
        import tempfile

        self.tmp = tempfile.mkdtemp(prefix="cat-fast-rank-")
        return self.tmp

    def __exit__(self, *exc):
        shutil.rmtree(self.tmp, ignore_errors=True)
        return False


def _finish(world: int) -> None:
    """Under torchrun: wait for every rank (rank 0 writes its outputs first), then leave the process group.

    The caller drops its trainer first, and the garbage is collected here: a DDP reducer that outlives the group
    would drop the group's last reference while holding the GIL, and gloo's destructor can then wait for ever on a
    worker thread that needs the GIL (tests/ranks.py)."""
    if world > 1:
        import gc

        import torch.distributed as dist

        gc.collect()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _history(logs: List[Dict], ends: List[int], cat_active_from: int, method: str) -> List[Dict]:
    """Per-epoch summaries (train loss and info means over the epoch's logged steps, dev accuracy) from the
    Trainer's log history."""
    history, start = [], 0
    evals = {int(h["cat_fast_epoch"]): h for h in logs if "cat_fast_epoch" in h}
    for e, end in enumerate(ends, 1):
        steps = [h for h in logs if "loss" in h and start < h.get("step", 0) <= end]
        info_keys = sorted({k for h in steps for k in h if "/" in k and not k.startswith("eval/")})
        ev = evals.get(e, {})
        names = sorted({k.split("/")[1] for k in ev if k.startswith("eval/")})
        history.append({
            "epoch": e,
            "step": end,
            "objective": "erm" if e <= cat_active_from else method,
            "train_loss": sum(h["loss"] for h in steps) / len(steps) if steps else float("nan"),
            "info": {k.split("/", 1)[1]: sum(h[k] for h in steps if k in h) / max(1, sum(k in h for h in steps))
                     for k in info_keys},
            "eval": {n: {"accuracy": ev[f"eval/{n}/accuracy"], "n": int(ev[f"eval/{n}/n"])} for n in names},
        })
        start = end
    return history
