"""``cat-fast train``: fine-tune a classifier with a registered objective (`cat_fast.objectives`) on CAD data."""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Dict, List

from .. import objectives
from .common import (
    AtomicDir,
    CliError,
    autocast,
    get_device,
    parse_evals,
    plot,
    save_checkpoint,
    seed_everything,
    setup_device,
    to_device,
    write_json,
)
from .common import eval_sets as build_eval_sets

__all__ = ["train"]


def train(args) -> Dict:
    import torch
    from tqdm.auto import tqdm

    from .. import data as D
    from ..models.pretrained import load_classifier

    t_start = time.time()
    task = D.TASKS[args.task]
    method = args.method
    entry = objectives.get(method)
    data_mode = args.data or entry.data
    out = args.out or os.path.join("runs", f"{args.task}-{method}-seed{args.seed}")
    AtomicDir.check(out, args.overwrite)
    reserved = ("dev", "dev_orig", "dev_edit")
    evals = parse_evals(args.eval, reserved)
    for opt, v in (("--lr", args.lr), ("--weight-decay", args.weight_decay), ("--lr-warmup-ratio", args.lr_warmup_ratio)):
        if not math.isfinite(v) or v < 0:
            raise CliError(f"{opt} must be a finite non-negative number, got {v}")
    if args.lr_warmup_ratio > 1:
        raise CliError(f"--lr-warmup-ratio must be in [0, 1], got {args.lr_warmup_ratio}")
    device = get_device(args.device)
    setup_device(device)
    seed_everything(args.seed)

    # ---- data (validated before anything is written)
    train = D.load_train(args.task, args.train)
    if args.per_class:
        train = D.few_shot(train, args.per_class, seed=args.seed, with_edits=(data_mode == "orig+edits"))
    elif data_mode == "orig":
        train = train.originals()
    use_pairs = entry.cls.needs_pairs
    if use_pairs and not train.has_pairs:
        why = ("--data orig drops the edits" if data_mode == "orig" else
               "use a paired sentiment file (with batch_id) or NLI revised files after the originals")
        raise CliError(f"--method {method} needs counterfactual pairs in the training data, found none ({why})")
    # validate every evaluation file now, tokenise later
    for name, path in evals:
        D.load_eval(args.task, path)
    if args.dev:
        D.load_eval(args.task, args.dev)

    # ---- model
    attn = args.attn if args.attn != "auto" else ("eager" if entry.eager_attention else None)
    seed_everything(args.seed)  # the fresh head's initialisation depends on the seed only
    model, tokenizer = load_classifier(args.model, task.num_labels, attn_implementation=attn, label_names=task.labels)
    model.to(device)

    train_tok = D.TokenizedData(train, tokenizer, args.max_length)
    eval_sets = build_eval_sets(args.task, args.dev, evals, tokenizer, args.max_length)
    sampler = D.make_batches(train, args.batch_size, keep_groups=use_pairs, shuffle=True, seed=args.seed)
    epoch_batches = [sampler.batches(e) for e in range(args.epochs)]
    total_steps = sum(len(b) for b in epoch_batches)
    cat_active_from = args.warmup_epochs if entry.warmup else 0
    warmup_steps = sum(len(b) for b in epoch_batches[:cat_active_from])
    if entry.warmup and cat_active_from >= args.epochs:
        sys.stderr.write(f"cat-fast: warning: --warmup-epochs {args.warmup_epochs} >= --epochs {args.epochs}: "
                         f"{method} trains with plain ERM only\n")

    # the registry's preset, then the command line (a CPU generator seeded by --seed: λ, partners and layers are
    # reproducible on any device); warm-up epochs run here as plain ERM
    objective = objectives.build(method, model, options=vars(args))

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    lr_warm = int(round(args.lr_warmup_ratio * total_steps))

    def lr_lambda(step):
        if step < lr_warm:
            return (step + 1) / lr_warm
        return max(0.0, (total_steps - step) / max(1, total_steps - lr_warm))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    config = {k: v for k, v in vars(args).items() if k not in ("command",)}
    config.update(data=data_mode, out=out, attn=attn or "default", device=str(device))
    ckpt_meta = {"task": args.task, "method": method, "max_length": args.max_length, "labels": list(task.labels),
                 "base_model": args.model, "seed": args.seed}

    atomic = AtomicDir(out, args.overwrite)
    with atomic as tmp:
        seed_everything(args.seed)
        model.train()
        losses: List[float] = []
        history: List[Dict] = []
        train_seconds = 0.0
        step = 0
        bar = tqdm(total=total_steps, desc=f"{args.task}/{method}", file=sys.stderr, dynamic_ncols=True, leave=True)
        try:
            for epoch in range(args.epochs):
                collate = D.Collator(tokenizer, partner=train.choose_partners(args.seed + epoch) if use_pairs else None)
                use_objective = objective is not None and epoch >= cat_active_from
                info_sums: Dict[str, float] = {}
                t0 = time.time()
                for idx in epoch_batches[epoch]:
                    batch = to_device(collate([train_tok[i] for i in idx]), device)
                    pairs = batch.pop("pairs", None)
                    with autocast(device, args.bf16):
                        if not use_objective:
                            loss, info = model(**batch).loss, {}
                        elif use_pairs:
                            loss, info = objective(batch, pairs)
                        else:
                            loss, info = objective(batch)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    if args.max_grad_norm > 0:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    scheduler.step()
                    step += 1
                    lv = float(loss.detach())
                    losses.append(lv)
                    for k, v in (info or {}).items():
                        try:
                            info_sums[k] = info_sums.get(k, 0.0) + float(v.detach() if hasattr(v, "detach") else v)
                        except (TypeError, ValueError, RuntimeError):
                            pass
                    bar.update(1)
                    bar.set_postfix(epoch=epoch + 1, loss=f"{lv:.4f}", refresh=False)
                train_seconds += time.time() - t0
                n_b = max(1, len(epoch_batches[epoch]))
                ev = eval_sets[0].evaluate(model, args.eval_batch_size, device, args.bf16)
                history.append({
                    "epoch": epoch + 1,
                    "step": step,
                    "objective": ("erm" if not use_objective else method),
                    "train_loss": sum(losses[-n_b:]) / n_b if epoch_batches[epoch] else float("nan"),
                    "info": {k: v / n_b for k, v in info_sums.items()},
                    "eval": ev,
                })
                bar.set_postfix(epoch=epoch + 1, loss=f"{losses[-1]:.4f}" if losses else "-", dev=f"{ev['dev']['accuracy']:.3f}")
        finally:
            bar.close()

        results = dict(history[-1]["eval"]) if history else {}
        for s in eval_sets[1:]:
            results.update(s.evaluate(model, args.eval_batch_size, device, args.bf16))

        if not args.no_checkpoint:
            save_checkpoint(tmp, model, tokenizer, ckpt_meta)
        metrics = {
            "method": method,
            "task": args.task,
            "model": args.model,
            "seed": args.seed,
            "eval": results,
            "train_seconds": round(train_seconds, 3),
            "steps": step,
            "total_seconds": round(time.time() - t_start, 3),
            "warmup_steps": warmup_steps,
            "data": {"mode": data_mode, "n_train": len(train), "n_orig": train.n_orig, "n_edits": len(train) - train.n_orig,
                     "classes": train.class_counts(), "groups": len(train.groups)},
            "history": history,
            "config": config,
        }
        write_json(os.path.join(tmp, "metrics.json"), metrics)
        plot(os.path.join(tmp, "curves.png"), losses, history, warmup_steps,
              f"{args.task} / {method} / {os.path.basename(str(args.model).rstrip('/'))} / seed {args.seed}")
        metrics["total_seconds"] = round(time.time() - t_start, 3)
        write_json(os.path.join(tmp, "metrics.json"), metrics)
        atomic.commit()
    sys.stderr.write(f"cat-fast: wrote {out} (dev accuracy {results.get('dev', {}).get('accuracy', float('nan')):.4f})\n")
    return metrics
