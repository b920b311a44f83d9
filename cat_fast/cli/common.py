"""Shared pieces of the ``cat-fast`` commands: one-line errors, the atomic output directory, devices, evaluation,
plots and checkpoints."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["CliError", "TrainingFailed", "float_pair", "PRESETS", "MARKER", "mark_output", "Parser", "fail", "AtomicDir", "CHECKPOINT_META", "DATA_MODES", "parse_evals", "get_device", "encode_batches",
           "setup_device", "seed_everything", "autocast", "to_device", "predict", "predict_logits", "predict_probs", "accuracy", "confusion", "EvalSet",
           "plot", "write_json", "save_checkpoint", "int_at_least", "positive_int", "nonneg_int", "int_list"]


DATA_MODES = ("orig", "orig+edits")


CHECKPOINT_META = "cat_fast.json"


class CliError(Exception):
    """A user error reported as one line with exit status 2."""

    exit_code = 2


class TrainingFailed(CliError):
    """A run that cannot go on (its loss became non-finite): one line, exit status 3."""

    exit_code = 3


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``cat-fast: error: ...``), exit status 2."""

    def error(self, message):
        fail(message)


def fail(message, code: int = 2) -> None:
    msg = " ".join(str(message).split())
    sys.stderr.write(f"cat-fast: error: {msg}\n")
    sys.stderr.flush()
    raise SystemExit(code)


# ------------------------------------------------------------------------------------------------
# argument parsing


def int_at_least(low: int, what: str):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            v = low - 1
        if v < low:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {s!r}")
        return v

    return parse


positive_int = int_at_least(1, "positive")


nonneg_int = int_at_least(0, "non-negative")


def int_list(s: str) -> List[int]:
    try:
        out = [int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers such as 4,5, got {s!r}")
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers >= 1 such as 4,5, got {s!r}")
    return out


def float_pair(s: str) -> Tuple[float, float]:
    """``A,B`` as two finite numbers with A <= B (e.g. the CRM clip range 0.9,2)."""
    try:
        a, b = (float(x) for x in s.replace(" ", "").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two comma-separated numbers such as 0.9,2, got {s!r}")
    if not (math.isfinite(a) and math.isfinite(b)) or a > b:
        raise argparse.ArgumentTypeError(f"expected two finite numbers A,B with A <= B such as 0.9,2, got {s!r}")
    return a, b


EVAL_RE = re.compile(r"^([A-Za-z0-9_.\-]+)=(.+)$")


PRESETS = ("hans",)  # --eval NAME without a file: a challenge set shipped with cat_fast


def parse_evals(specs: Sequence[str], reserved: Sequence[str] = ()) -> List[Tuple[str, str]]:
    out, seen = [], set(reserved)
    for s in specs:
        if s in PRESETS and s not in seen:
            seen.add(s)
            out.append((s, None))
            continue
        m = EVAL_RE.match(s)
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


MARKER = ".cat-fast"  # in every directory cat-fast writes: what --overwrite may replace


def mark_output(directory: str) -> None:
    with open(os.path.join(directory, MARKER), "w") as f:
        f.write("written by cat-fast; `cat-fast ... --overwrite` may replace this directory\n")


def _within(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def _resolve_out(path: str) -> str:
    """The absolute output path, a symbolic link to a directory followed; a dangling link is refused."""
    path = os.path.abspath(path)
    if os.path.islink(path):
        target = os.path.realpath(path)
        if not os.path.exists(target):
            raise CliError(f"--out {path} is a symbolic link to {target}, which does not exist: create the target "
                           "directory or choose another --out")
        return target
    return path


class AtomicDir:
    """Write into a temporary sibling of ``path``; ``commit()`` renames it into place.

    On an exception (or KeyboardInterrupt) before commit, the temporary directory and any parent
    directories created for it are removed.
    """

    def __init__(self, path: str, overwrite: bool):
        self.path = _resolve_out(path)
        self.overwrite = overwrite
        self.tmp: Optional[str] = None
        self.created: List[str] = []

    @staticmethod
    def check(path: str, overwrite: bool, inputs: Sequence[str] = ()) -> str:
        """An existing non-empty `path` is replaced only with `overwrite`, only when cat-fast wrote it (its marker
        file), and never when it is or holds the working directory or one of the run's `inputs`. Returns the path
        written: a symbolic link to a directory is followed (the link stays, its target is replaced)."""
        path = _resolve_out(path)
        if os.path.exists(path) and not os.path.isdir(path):
            raise CliError(f"--out {path} exists and is not a directory")
        if not (os.path.isdir(path) and os.listdir(path)):
            return path
        if not overwrite:
            raise CliError(f"--out {path} exists and is not empty; pass --overwrite to replace it")
        real = os.path.realpath(path)
        from .sources import split_of  # DIR@SPLIT (a split of a dataset folder) is DIR on the file system

        inputs = [split_of(str(p))[0] for p in inputs if p]
        for inside in [os.getcwd()] + [p for p in inputs if os.path.exists(p)]:
            if _within(os.path.realpath(inside), real):
                what = "the working directory" if inside == os.getcwd() else f"the input {inside}"
                raise CliError(f"--out {path} holds {what}; --overwrite replaces only a directory cat-fast wrote, "
                               "choose another --out")
        if not os.path.isfile(os.path.join(path, MARKER)):
            raise CliError(f"--out {path} was not written by cat-fast (no {MARKER} file in it); --overwrite "
                           "replaces only a directory cat-fast wrote, choose another --out or remove it yourself")
        return path

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
        mark_output(self.tmp)
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


def get_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device is available (use --device cpu or auto)")
    return torch.device(name)


def setup_device(device) -> None:
    import torch

    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's generators (every device): `transformers.set_seed`."""
    from transformers import set_seed

    set_seed(seed % 2**32)  # numpy's range (seed + rank under torchrun may pass it)


def autocast(device, bf16: bool):
    import contextlib

    import torch

    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def to_device(batch: Dict, device) -> Dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def encode_batches(tokenizer, data, rows: Sequence[int], batch_size: int, max_length: int, device) -> List[Dict]:
    """The examples `rows` of `data` (a CadData) as tokenised batches of `batch_size` on `device`, in that order:
    dicts of the model's inputs and ``labels``."""
    import torch

    out = []
    for start in range(0, len(rows), batch_size):
        idx = list(rows[start:start + batch_size])
        pair = [data.text_pair[i] for i in idx] if data.text_pair is not None else None
        enc = tokenizer([data.text[i] for i in idx], pair, padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        batch = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        batch["labels"] = torch.tensor([data.labels[i] for i in idx], device=device)
        out.append(batch)
    return out


def predict_logits(model, tokenized, batch_size: int, device, bf16: bool = False):
    """Logits [N, C] (float32, CPU) for every example of a TokenizedData, in its order (length-sorted batches,
    deterministic)."""
    import torch

    from ..data import Collator

    collate = Collator(tokenized.tokenizer)
    order = sorted(range(len(tokenized)), key=lambda i: (len(tokenized.features[i]["input_ids"]), i))
    out = torch.empty(len(tokenized), model.config.num_labels)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            batch = collate([tokenized[i] for i in idx])
            batch.pop("labels")
            with autocast(device, bf16):
                logits = model(**to_device(batch, device)).logits
            out[torch.tensor(idx)] = logits.float().cpu()
    model.train(was_training)
    return out


def predict(model, tokenized, batch_size: int, device, bf16: bool = False) -> List[int]:
    """Argmax predictions for every example of a TokenizedData."""
    return predict_logits(model, tokenized, batch_size, device, bf16).argmax(-1).tolist()


def predict_probs(model, tokenized, batch_size: int, device, bf16: bool = False):
    """Class probabilities [N, C] (float32, CPU) for every example of a TokenizedData, in its order."""
    return predict_logits(model, tokenized, batch_size, device, bf16).softmax(-1)


def accuracy(preds: Sequence[int], labels: Sequence[int], mask: Optional[Sequence[bool]] = None) -> Dict:
    pairs = [(p, y) for k, (p, y) in enumerate(zip(preds, labels)) if mask is None or mask[k]]
    n = len(pairs)
    return {"accuracy": (sum(p == y for p, y in pairs) / n) if n else float("nan"), "n": n}


def confusion(preds: Sequence[int], labels: Sequence[int], names: Sequence[str],
              mask: Optional[Sequence[bool]] = None) -> Dict:
    """``{"labels": names, "matrix": counts}``: ``matrix[gold][predicted]`` over the examples `mask` keeps."""
    matrix = [[0] * len(names) for _ in names]
    for k, (p, y) in enumerate(zip(preds, labels)):
        if mask is None or mask[k]:
            matrix[y][p] += 1
    return {"labels": list(names), "matrix": matrix}


class EvalSet:
    """One scored set: accuracy (HANS: by heuristic and label), with ``confusion=True`` also its confusion matrix
    (`confusion`, under the key ``confusion`` of each score)."""

    def __init__(self, name: str, data, tokenizer, max_length: int, split_orig_edit: bool = False,
                 confusion: bool = False):
        from ..data import TokenizedData

        self.name = name
        self.data = data
        self.tokenized = TokenizedData(data, tokenizer, max_length)
        self.split_orig_edit = split_orig_edit
        self.confusion = confusion

    def evaluate(self, model, batch_size, device, bf16) -> Dict[str, Dict]:
        preds = predict(model, self.tokenized, batch_size, device, bf16)
        names = [model.config.id2label[i] for i in range(model.config.num_labels)]
        if self.name == "hans" and hasattr(self.data, "heuristic"):  # accuracy by heuristic x label, as HANS reports
            from ..data import HANS_LABELS, score_hans

            out = score_hans(preds, self.data, names)
            if self.confusion:  # entailment / non-entailment, as HANS scores
                two = [int(names[p] != HANS_LABELS[0]) for p in preds]
                gold = [int(self.data.label_names[y] != HANS_LABELS[0]) for y in self.data.labels]
                out[self.name]["confusion"] = confusion(two, gold, HANS_LABELS)
            return out
        if len(self.data.label_names) == len(names):  # a model with unnamed labels: the data's names, in id order
            names = list(self.data.label_names)
        parts = [(self.name, None)]
        if self.split_orig_edit:
            parts += [(f"{self.name}_orig", self.data.is_orig), (f"{self.name}_edit", [not o for o in self.data.is_orig])]
        out = {}
        for key, mask in parts:
            out[key] = accuracy(preds, self.data.labels, mask)
            if self.confusion:
                out[key]["confusion"] = confusion(preds, self.data.labels, names, mask)
        return out


def plot(path: str, logs: List[Dict], history: List[Dict], warmup_steps: int, title: str) -> None:
    """``curves.png``: the loss and its ERM and counterfactual parts per logged step, dev accuracy per epoch, and (for
    CAT) λ before / after CAL and the mean CRM weight."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    steps = [h for h in logs if "loss" in h and "step" in h]
    parts = [(k, label) for k, label in (("cat/erm_loss", "ERM part"), ("cat/crm_loss", "CRM part"),
                                          ("objective/erm_loss", "ERM part"), ("objective/crm_loss", "CRM part"),
                                          ("gs/ce_loss", "CE part"), ("gs/gs_loss", "GS part"),
                                          ("objective/ce_loss", "CE part"), ("objective/gs_loss", "GS part"))
             if any(k in h for h in steps)]
    lam = [k for k in ("lambda_before", "lambda_after", "crm_weight_mean")
           if any(f"{p}/{k}" in h for h in steps for p in ("cat", "objective"))]
    fig, axes = plt.subplots(1, 3 if lam else 2, figsize=(15 if lam else 10, 3.6))
    a, b = axes[0], axes[1]
    xs = [h["step"] for h in steps]
    a.plot(xs, [h["loss"] for h in steps], lw=0.8, alpha=0.6, label="loss")
    for key, label in parts:
        after = key.endswith(("crm_loss", "gs_loss"))  # the counterfactual part: 0 during a warm-up, not shown there
        pts = [(h["step"], h[key]) for h in steps if key in h and not (after and h["step"] <= warmup_steps)]
        a.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.0, label=label)
    if 0 < warmup_steps < (xs[-1] if xs else 0):
        a.axvspan(0, warmup_steps, color="grey", alpha=0.15, label="ERM warm-up")
    a.set_xlabel("optimizer step")
    a.set_ylabel("training loss")
    a.legend(fontsize=8)
    ev_x = [h["step"] for h in history]
    for key in sorted({k for h in history for k in h.get("eval", {})}):
        b.plot(ev_x, [h["eval"].get(key, {}).get("accuracy", float("nan")) for h in history], marker="o", label=key)
    b.set_xlabel("optimizer step (end of each epoch)")
    b.set_ylabel("accuracy")
    if history and any(h.get("eval") for h in history):
        b.legend(fontsize=8)
    if lam:
        c = axes[2]
        for k in lam:
            key = next(f"{p}/{k}" for p in ("cat", "objective") if any(f"{p}/{k}" in h for h in steps))
            pts = [(h["step"], h[key]) for h in steps if key in h and (h["step"] > warmup_steps)]
            c.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.0, label=k.replace("_", " "))
        c.set_xlabel("optimizer step (after the warm-up)")
        c.set_ylabel("λ / CRM weight")
        c.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def save_checkpoint(directory: str, model, tokenizer, meta: Dict) -> None:
    from ..models.pretrained import _quiet_transformers

    with _quiet_transformers():
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    write_json(os.path.join(directory, CHECKPOINT_META), meta)
