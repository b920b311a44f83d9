"""``cat-fast``: train and evaluate text classifiers with ERM, CAT and gradient supervision on CAD data.

    cat-fast train --task sentiment --method cat --per-class 32 --epochs 2 --max-length 128 --out runs/demo
    cat-fast eval  --model runs/demo --task sentiment --eval dev=cat_fast/data/cad/sentiment/orig/dev.tsv

Methods (``--method``):

=========== ============================================ ==========================
method      objective                                    default training data
=========== ============================================ ==========================
erm         ``model(**batch).loss``                      originals + edits
erm-orig    ``model(**batch).loss``                      originals only
cat         ``CAT(adv_steps=3)``                         originals + edits
cat-star    ``CAT(adv_steps=0)`` (CMIX + CRM, no CAL)    originals + edits
cat-gs      ``CAT(gs_weight=1.0)``                       originals + edits
gs          ``GradientSupervision`` on CAD pairs         originals + edits, pairs
gs-random   ``GradientSupervision(random_pairs=True)``   originals + edits, pairs
=========== ============================================ ==========================

``--data orig`` / ``--data orig+edits`` overrides the training data (the few-shot protocol of the CAT
paper trains cat / cat-star on originals only). CAT methods train with plain ERM for the first
``--warmup-epochs`` epochs (default 1; SPEC §1.4, paper Algorithm 1).

Defaults, chosen so that the README run (MiniLM, 32 originals per class, 2 epochs) takes a few minutes
on a 2-core CPU: ``--model minilm``, ``--epochs 3``, ``--batch-size 8`` (the paper's), ``--lr 5e-5`` (AdamW, weight
decay 0.01 except biases and LayerNorm weights, linear decay to 0, gradient clipping at 1.0),
``--max-length 128``, ``--seed 0``. The paper's other settings (lr 1e-5/2e-5, 20-30 epochs) are one flag away.

Batches: for gs / gs-random, whole groups (an original and its edits) go into one batch, so every sample's
counterfactual is in its batch (``pairs``); the other methods shuffle single examples. Either way batches
are drawn with ``--seed`` (+ the epoch).

Evaluation: ``dev`` (the task's built-in CAD dev set, originals + edits, unless ``--dev``) after every
epoch; with the built-in dev set also ``dev_orig`` and ``dev_edit`` (its originals and its edits). The
final model is the one after the last epoch (no checkpoint selection).

Output ``--out DIR``: ``metrics.json``, the checkpoint (``config.json``, ``model.safetensors``, tokenizer
files, ``cat_fast.json``) and ``curves.png``. Everything is written into a temporary sibling directory
that is renamed into place at the end, so a failed or interrupted run leaves no DIR behind.

Bad input exits with status 2 and one line on stderr: ``cat-fast: error: ...``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["main", "build_parser", "CliError"]

METHODS = ("erm", "erm-orig", "cat", "cat-star", "gs", "gs-random", "cat-gs")
CAT_METHODS = ("cat", "cat-star", "cat-gs")
GS_METHODS = ("gs", "gs-random")
DATA_MODES = ("orig", "orig+edits")
CHECKPOINT_META = "cat_fast.json"


class CliError(Exception):
    """A user error reported as one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``cat-fast: error: ...``), exit status 2."""

    def error(self, message):
        _fail(message)


def _fail(message) -> None:
    msg = " ".join(str(message).split())
    sys.stderr.write(f"cat-fast: error: {msg}\n")
    sys.stderr.flush()
    raise SystemExit(2)


# ------------------------------------------------------------------------------------------------
# argument parsing


def _int_at_least(low: int, what: str):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            v = low - 1
        if v < low:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {s!r}")
        return v

    return parse


_positive_int = _int_at_least(1, "positive")
_nonneg_int = _int_at_least(0, "non-negative")


def _int_list(s: str) -> List[int]:
    try:
        out = [int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers such as 4,5, got {s!r}")
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers >= 1 such as 4,5, got {s!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="cat-fast", description="Train and evaluate text classifiers with counterfactual methods (CAT, GS) on CAD data.")
    sub = p.add_subparsers(dest="command", metavar="{train,eval}", parser_class=_Parser)
    sub.required = True

    t = sub.add_parser("train", help="train a classifier", description="Train a classifier (see `python -m pydoc cat_fast.cli`).")
    t.add_argument("--task", required=True, choices=("sentiment", "nli"))
    t.add_argument("--method", required=True, choices=METHODS)
    t.add_argument("--train", nargs="+", metavar="FILE", help="training files (default: the built-in CAD train split). "
                   "sentiment: a paired file (with batch_id) or plain files; nli: originals, then revised files paired by position")
    t.add_argument("--dev", metavar="FILE", help="dev file evaluated after every epoch as 'dev' (default: the built-in CAD dev set)")
    t.add_argument("--eval", nargs="+", action="extend", metavar="NAME=FILE", default=[], help="extra evaluation sets")
    t.add_argument("--data", choices=DATA_MODES, help="training data: originals only or originals + edits (default: by method)")
    t.add_argument("--model", default="minilm", help="model directory, or 'minilm' (default)")
    t.add_argument("--epochs", type=_positive_int, default=3)
    t.add_argument("--batch-size", type=_positive_int, default=8)
    t.add_argument("--lr", type=float, default=5e-5)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--lr-warmup-ratio", type=float, default=0.0, help="fraction of steps with linear lr warm-up (default 0)")
    t.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0 = off)")
    t.add_argument("--max-length", type=_positive_int, default=128)
    t.add_argument("--per-class", type=_positive_int, metavar="K", help="few-shot: K original examples per class (+ their edits)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    t.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    t.add_argument("--attn", default="auto", choices=("auto", "eager", "sdpa"),
                   help="attention implementation; auto = eager for gs, gs-random and cat-gs (exact double backward), else the default")
    t.add_argument("--eval-batch-size", type=_positive_int, default=64)
    t.add_argument("--out", metavar="DIR", help="output directory (default: runs/TASK-METHOD-seedN)")
    t.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --out")
    t.add_argument("--no-checkpoint", action="store_true",
                   help="write metrics and curves but not the model weights (for seed sweeps)")
    g = t.add_argument_group("CAT / GS")
    g.add_argument("--warmup-epochs", type=_nonneg_int, default=1, help="CAT methods: plain ERM epochs first (default 1)")
    g.add_argument("--cat-layers", type=_int_list, metavar="M,M,...", help="CAT mixing layers Q (default: the objective's)")
    g.add_argument("--alpha", type=float, default=0.3)
    g.add_argument("--beta", type=float, default=0.3)
    g.add_argument("--gamma", type=float, default=10.0)
    g.add_argument("--eta", type=float, default=20.0)
    g.add_argument("--adv-steps", type=_nonneg_int, help="CAL steps (default: 3 for cat and cat-gs, 0 for cat-star)")
    g.add_argument("--adv-lr", type=float, default=2e-2)
    g.add_argument("--mask-mode", default="self", choices=("self", "partner", "union", "intersection"))
    g.add_argument("--cat-update", choices=("sum", "alternate"), default="sum",
                   help="CAT update: one summed ERM + CRM loss (default), or the paper's alternating CRM then ERM steps")
    g.add_argument("--crm-lr", type=float, default=2e-5, help="learning rate of the CRM step with --cat-update alternate")
    g.add_argument("--gs-weight", type=float, default=1.0, help="weight of the GS loss (gs, gs-random, cat-gs; default 1.0)")

    e = sub.add_parser("eval", help="evaluate a trained classifier", description="Evaluate a checkpoint written by `cat-fast train`.")
    e.add_argument("--model", required=True, metavar="DIR")
    e.add_argument("--task", choices=("sentiment", "nli"), help="default: the task stored in the checkpoint")
    e.add_argument("--eval", nargs="+", action="extend", metavar="NAME=FILE", default=[],
                   help="evaluation sets (default: the built-in dev set as dev, dev_orig, dev_edit)")
    e.add_argument("--max-length", type=_positive_int, help="default: the checkpoint's training max length, else 128")
    e.add_argument("--eval-batch-size", type=_positive_int, default=64)
    e.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    e.add_argument("--bf16", action="store_true")
    e.add_argument("--out", metavar="DIR", help="write DIR/metrics.json (default: print JSON)")
    e.add_argument("--overwrite", action="store_true")
    return p


_EVAL_RE = re.compile(r"^([A-Za-z0-9_.\-]+)=(.+)$")


def _parse_evals(specs: Sequence[str], reserved: Sequence[str] = ()) -> List[Tuple[str, str]]:
    out, seen = [], set(reserved)
    for s in specs:
        m = _EVAL_RE.match(s)
        if not m:
            raise CliError(f"--eval expects NAME=FILE (NAME of letters, digits, '_', '-', '.'), got {s!r}")
        name, path = m.group(1), m.group(2)
        if name in seen:
            raise CliError(f"--eval name {name!r} is used twice (or is reserved: {', '.join(reserved) or 'none'})")
        seen.add(name)
        out.append((name, path))
    return out


# ------------------------------------------------------------------------------------------------
# output directory, written atomically


class _AtomicDir:
    """Write into a temporary sibling of ``path``; ``commit()`` renames it into place.

    On an exception (or KeyboardInterrupt) before commit, the temporary directory and any parent
    directories created for it are removed.
    """

    def __init__(self, path: str, overwrite: bool):
        self.path = os.path.abspath(path)
        self.overwrite = overwrite
        self.tmp: Optional[str] = None
        self.created: List[str] = []

    @staticmethod
    def check(path: str, overwrite: bool) -> None:
        if os.path.exists(path) and not os.path.isdir(path):
            raise CliError(f"--out {path} exists and is not a directory")
        if os.path.isdir(path) and os.listdir(path) and not overwrite:
            raise CliError(f"--out {path} exists and is not empty; pass --overwrite to replace it")

    def __enter__(self) -> str:
        parent = os.path.dirname(self.path)
        missing = []
        d = parent
        while d and not os.path.isdir(d):
            missing.append(d)
            d = os.path.dirname(d)
        try:
            os.makedirs(parent, exist_ok=True)
            self.created = missing  # deepest first
            self.tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(self.path)}.tmp-", dir=parent)
        except OSError as e:
            raise CliError(f"cannot create the output directory {self.path}: {e.strerror or e}") from e
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.tmp, 0o777 & ~umask)  # mkdtemp makes 0700; give the final DIR ordinary permissions
        return self.tmp

    def commit(self) -> None:
        old = None
        if os.path.isdir(self.path):
            if os.listdir(self.path):
                old = tempfile.mkdtemp(prefix=f".{os.path.basename(self.path)}.old-", dir=os.path.dirname(self.path))
                os.rmdir(old)
                os.replace(self.path, old)
            else:
                os.rmdir(self.path)
        os.replace(self.tmp, self.path)
        self.tmp = None
        if old:
            shutil.rmtree(old, ignore_errors=True)

    def __exit__(self, exc_type, exc, tb):
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
            for d in self.created:
                try:
                    os.rmdir(d)
                except OSError:
                    break
        return False


# ------------------------------------------------------------------------------------------------
# helpers


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device is available (use --device cpu or auto)")
    return torch.device(name)


def _setup_device(device) -> None:
    import torch

    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def _autocast(device, bf16: bool):
    import contextlib

    import torch

    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def _to(batch: Dict, device) -> Dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def predict(model, tokenized, batch_size: int, device, bf16: bool = False) -> List[int]:
    """Argmax predictions for every example of a TokenizedData (length-sorted batches, deterministic)."""
    import torch

    from .data import Collator

    collate = Collator(tokenized.tokenizer)
    order = sorted(range(len(tokenized)), key=lambda i: (len(tokenized.features[i]["input_ids"]), i))
    preds = [0] * len(tokenized)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            batch = collate([tokenized[i] for i in idx])
            batch.pop("labels")
            with _autocast(device, bf16):
                logits = model(**_to(batch, device)).logits
            for i, p in zip(idx, logits.argmax(-1).tolist()):
                preds[i] = p
    model.train(was_training)
    return preds


def _accuracy(preds: Sequence[int], labels: Sequence[int], mask: Optional[Sequence[bool]] = None) -> Dict:
    pairs = [(p, y) for k, (p, y) in enumerate(zip(preds, labels)) if mask is None or mask[k]]
    n = len(pairs)
    return {"accuracy": (sum(p == y for p, y in pairs) / n) if n else float("nan"), "n": n}


class _EvalSet:
    def __init__(self, name: str, data, tokenizer, max_length: int, split_orig_edit: bool = False):
        from .data import TokenizedData

        self.name = name
        self.data = data
        self.tokenized = TokenizedData(data, tokenizer, max_length)
        self.split_orig_edit = split_orig_edit

    def evaluate(self, model, batch_size, device, bf16) -> Dict[str, Dict]:
        preds = predict(model, self.tokenized, batch_size, device, bf16)
        out = {self.name: _accuracy(preds, self.data.labels)}
        if self.split_orig_edit:
            out[f"{self.name}_orig"] = _accuracy(preds, self.data.labels, self.data.is_orig)
            out[f"{self.name}_edit"] = _accuracy(preds, self.data.labels, [not o for o in self.data.is_orig])
        return out


def _eval_sets(task: str, dev: Optional[str], evals: List[Tuple[str, str]], tokenizer, max_length: int,
               include_dev: bool = True) -> List[_EvalSet]:
    from . import data as D

    sets = []
    if include_dev:
        if dev:
            sets.append(_EvalSet("dev", D.load_eval(task, dev), tokenizer, max_length))
        else:
            sets.append(_EvalSet("dev", D.load_builtin(task, "dev"), tokenizer, max_length, split_orig_edit=True))
    for name, path in evals:
        sets.append(_EvalSet(name, D.load_eval(task, path), tokenizer, max_length))
    return sets


def _plot(path: str, losses: List[float], history: List[Dict], warmup_steps: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = list(range(1, len(losses) + 1))
    a.plot(steps, losses, lw=0.8, alpha=0.5, label="loss")
    if len(losses) >= 5:
        w = max(2, len(losses) // 20)
        smooth = [sum(losses[max(0, i - w + 1):i + 1]) / len(losses[max(0, i - w + 1):i + 1]) for i in range(len(losses))]
        a.plot(steps, smooth, lw=1.5, label=f"mean of {w}")
    if 0 < warmup_steps < len(losses):
        a.axvspan(0, warmup_steps, color="grey", alpha=0.15, label="ERM warm-up")
    a.set_xlabel("step")
    a.set_ylabel("training loss")
    a.legend(fontsize=8)
    xs = [h["step"] for h in history]
    for key in sorted({k for h in history for k in h.get("eval", {})}):
        b.plot(xs, [h["eval"].get(key, {}).get("accuracy", float("nan")) for h in history], marker="o", label=key)
    b.set_xlabel("step")
    b.set_ylabel("accuracy")
    b.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def _save_checkpoint(directory: str, model, tokenizer, meta: Dict) -> None:
    from .pretrained import _quiet_transformers

    with _quiet_transformers():
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    _write_json(os.path.join(directory, CHECKPOINT_META), meta)


# ------------------------------------------------------------------------------------------------
# train


def _build_objective(args, model):
    import torch

    method = args.method
    # a CPU generator makes λ, partners and layers reproducible for a seed on any device
    generator = torch.Generator().manual_seed(args.seed)
    if method in CAT_METHODS:
        from .cat import CAT

        adv_steps = args.adv_steps if args.adv_steps is not None else (0 if method == "cat-star" else 3)
        return CAT(
            model,
            layers=args.cat_layers,
            alpha=args.alpha,
            beta=args.beta,
            gamma=args.gamma,
            eta=args.eta,
            adv_steps=adv_steps,
            adv_lr=args.adv_lr,
            mask_mode=args.mask_mode,
            warmup_steps=0,  # the warm-up epochs are run here, as plain ERM
            gs_weight=args.gs_weight if method == "cat-gs" else 0.0,
            generator=generator,
            update=args.cat_update,
            # the paper's alternating step: a separate optimizer (lr 2e-5 in the paper) steps on CRM first
            crm_optimizer=torch.optim.AdamW(model.parameters(), lr=args.crm_lr) if args.cat_update == "alternate" else None,
        )
    if method in GS_METHODS:
        from .gs import GradientSupervision

        return GradientSupervision(model, weight=args.gs_weight, random_pairs=(method == "gs-random"), generator=generator)
    return None


def _train(args) -> Dict:
    import torch
    from tqdm.auto import tqdm

    from . import data as D
    from .pretrained import load_classifier

    t_start = time.time()
    task = D.TASKS[args.task]
    method = args.method
    data_mode = args.data or ("orig" if method == "erm-orig" else "orig+edits")
    out = args.out or os.path.join("runs", f"{args.task}-{method}-seed{args.seed}")
    _AtomicDir.check(out, args.overwrite)
    reserved = ("dev", "dev_orig", "dev_edit")
    evals = _parse_evals(args.eval, reserved)
    for opt, v in (("--lr", args.lr), ("--weight-decay", args.weight_decay), ("--lr-warmup-ratio", args.lr_warmup_ratio)):
        if not math.isfinite(v) or v < 0:
            raise CliError(f"{opt} must be a finite non-negative number, got {v}")
    if args.lr_warmup_ratio > 1:
        raise CliError(f"--lr-warmup-ratio must be in [0, 1], got {args.lr_warmup_ratio}")
    device = _device(args.device)
    _setup_device(device)
    seed_everything(args.seed)

    # ---- data (validated before anything is written)
    train = D.load_train(args.task, args.train)
    if args.per_class:
        train = D.few_shot(train, args.per_class, seed=args.seed, with_edits=(data_mode == "orig+edits"))
    elif data_mode == "orig":
        train = train.originals()
    use_pairs = method in GS_METHODS
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
    attn = args.attn if args.attn != "auto" else ("eager" if method in GS_METHODS + ("cat-gs",) else None)
    seed_everything(args.seed)  # the fresh head's initialisation depends on the seed only
    model, tokenizer = load_classifier(args.model, task.num_labels, attn_implementation=attn, label_names=task.labels)
    model.to(device)

    train_tok = D.TokenizedData(train, tokenizer, args.max_length)
    eval_sets = _eval_sets(args.task, args.dev, evals, tokenizer, args.max_length)
    sampler = D.make_batches(train, args.batch_size, keep_groups=use_pairs, shuffle=True, seed=args.seed)
    epoch_batches = [sampler.batches(e) for e in range(args.epochs)]
    total_steps = sum(len(b) for b in epoch_batches)
    cat_active_from = args.warmup_epochs if method in CAT_METHODS else 0
    warmup_steps = sum(len(b) for b in epoch_batches[:cat_active_from])
    if method in CAT_METHODS and cat_active_from >= args.epochs:
        sys.stderr.write(f"cat-fast: warning: --warmup-epochs {args.warmup_epochs} >= --epochs {args.epochs}: "
                         f"{method} trains with plain ERM only\n")

    objective = _build_objective(args, model)

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

    atomic = _AtomicDir(out, args.overwrite)
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
                    batch = _to(collate([train_tok[i] for i in idx]), device)
                    pairs = batch.pop("pairs", None)
                    with _autocast(device, args.bf16):
                        if not use_objective:
                            loss, info = model(**batch).loss, {}
                        elif method in GS_METHODS:
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
            _save_checkpoint(tmp, model, tokenizer, ckpt_meta)
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
        _write_json(os.path.join(tmp, "metrics.json"), metrics)
        _plot(os.path.join(tmp, "curves.png"), losses, history, warmup_steps,
              f"{args.task} / {method} / {os.path.basename(str(args.model).rstrip('/'))} / seed {args.seed}")
        metrics["total_seconds"] = round(time.time() - t_start, 3)
        _write_json(os.path.join(tmp, "metrics.json"), metrics)
        atomic.commit()
    sys.stderr.write(f"cat-fast: wrote {out} (dev accuracy {results.get('dev', {}).get('accuracy', float('nan')):.4f})\n")
    return metrics


# ------------------------------------------------------------------------------------------------
# eval


def _eval(args) -> Dict:
    from . import data as D
    from .pretrained import load_classifier, resolve_model_dir

    if args.out:
        _AtomicDir.check(args.out, args.overwrite)
    evals = _parse_evals(args.eval)
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
    device = _device(args.device)
    _setup_device(device)
    for _, path in evals:
        D.load_eval(task_name, path)
    model, tokenizer = load_classifier(directory, None)
    if model.config.num_labels != task.num_labels:
        raise CliError(f"{directory}: the model has {model.config.num_labels} labels, task {task_name} has "
                       f"{task.num_labels} ({', '.join(task.labels)})")
    model.to(device)
    sets = _eval_sets(task_name, None, evals, tokenizer, max_length, include_dev=not evals)
    results = {}
    for s in sets:
        results.update(s.evaluate(model, args.eval_batch_size, device, args.bf16))
    metrics = {"task": task_name, "model": args.model, "max_length": max_length, "eval": results}
    if args.out:
        atomic = _AtomicDir(args.out, args.overwrite)
        with atomic as tmp:
            _write_json(os.path.join(tmp, "metrics.json"), metrics)
            atomic.commit()
    else:
        sys.stdout.write(json.dumps(metrics, indent=2) + "\n")
    return metrics


# ------------------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``cat-fast``; returns 0, or raises SystemExit(2) on bad input (one line on stderr)."""
    args = build_parser().parse_args(argv)
    from .data import DataError
    from .pretrained import ModelLoadError

    try:
        if args.command == "train":
            _train(args)
        else:
            _eval(args)
    except (DataError, ModelLoadError, CliError) as e:
        _fail(e)
    except KeyboardInterrupt:
        sys.stderr.write("cat-fast: interrupted\n")
        raise SystemExit(130)
    return 0


if __name__ == "__main__":
    sys.exit(main())
