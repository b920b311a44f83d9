"""``cat-fast``: train and evaluate text classifiers with ERM, CAT and gradient supervision on CAD data.

    cat-fast train --task sentiment --method cat --per-class 32 --epochs 2 --max-length 128 --out runs/demo
    cat-fast eval  --model runs/demo --task sentiment --eval dev=cat_fast/data/cad/sentiment/orig/dev.tsv

Methods (``--method``; the names are the registry of `cat_fast.objectives`):

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
``--warmup-epochs`` epochs (default 1; docs/METHODS.md §1.4, paper Algorithm 1).

Defaults, chosen so that the README run (MiniLM, 32 originals per class, 2 epochs) takes a few minutes
on a 2-core CPU: ``--model minilm``, ``--epochs 3``, ``--batch-size 8`` (the paper's), ``--lr 5e-5`` (AdamW, weight
decay 0.01 except biases and LayerNorm weights, linear decay to 0, gradient clipping at 1.0),
``--max-length 128``, ``--seed 0``. The paper's other settings (lr 1e-5/2e-5, 20-30 epochs) are one flag away.

Batches: for gs / gs-random, whole groups (an original and its edits, or rows sharing a group id) go into one batch, so every sample's
counterfactual is in its batch (``pairs``); the other methods shuffle single examples. Either way batches
are drawn with ``--seed`` (+ the epoch).

Evaluation: ``dev`` (the task's built-in CAD dev set, originals + edits, unless ``--dev``) after every
epoch; with the built-in dev set also ``dev_orig`` and ``dev_edit`` (its originals and its edits). The
final model is the one after the last epoch (no checkpoint selection).

Data: ``--task`` (the built-in CAD data, or CAD-format files) or your own file with ``--text-column`` /
``--label-column`` [``--text-pair-column``, ``--group-column``, ``--id-column``, ``--labels``] (`sources`).
Training runs through `cat_fast.integrations.ObjectiveTrainer` (the Hugging Face Trainer): ``--grad-accum``,
``--bf16``, ``--report-to``, ``--save-steps`` checkpoints in ``DIR.checkpoints`` and ``--resume``. Under
``torchrun --nproc_per_node N`` it is data-parallel (DistributedDataParallel; `train`, README "Several GPUs and
machines").

Output ``--out DIR``: ``metrics.json``, the checkpoint (``config.json``, ``model.safetensors``, tokenizer
files, ``cat_fast.json``) and ``curves.png``. Everything is written into a temporary sibling directory
that is renamed into place at the end, so a failed or interrupted run (Ctrl-C, SIGTERM) leaves no DIR behind;
``--overwrite`` replaces only a directory cat-fast wrote (its ``.cat-fast`` marker).

Bad input exits with status 2 and one line on stderr: ``cat-fast: error: ...``; a loss that becomes NaN or
infinite stops the run with status 3.
"""
from __future__ import annotations

import argparse
import signal
import sys
from typing import Optional, Sequence

from .common import CliError, Parser, fail
from .parse_bias import add_bias
from .parse_eval import add_eval
from .parse_mediation import add_mediation
from .parse_shortcut import add_shortcut
from .parse_train import add_train

__all__ = ["main", "build_parser", "CliError"]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = Parser(prog="cat-fast", formatter_class=fmt,
               description="Train and evaluate text classifiers with counterfactual and debiasing objectives (CAT, "
                           "gradient supervision) on the built-in CAD data or your own files.")
    p.add_argument("--version", action="version", version=f"cat-fast {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{train,eval,predict,bias,mediation,mask,unlearn,shortcut}",
                           parser_class=Parser)
    sub.required = True

    for add in (add_train, add_eval, add_bias, add_mediation, add_shortcut):
        add(sub, fmt)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``cat-fast``; returns 0, or raises SystemExit(2) on bad input (one line on stderr)."""
    args = build_parser().parse_args(argv)
    from ..data import DataError
    from ..models.pretrained import ModelLoadError
    from .evaluate import evaluate
    from .train import train

    previous = signal.signal(signal.SIGTERM, _terminated)  # SIGTERM ends a run like Ctrl-C: nothing half-written
    try:
        if args.command == "train":
            train(args)
        elif args.command == "bias":
            from .bias import fit

            fit(args)
        elif args.command == "shortcut":
            from .shortcut import plant

            plant(args)
        elif args.command == "predict":
            from .predict import predict

            predict(args)
        elif args.command in ("mediation", "mask", "unlearn"):
            from . import mediation

            getattr(mediation, args.command)(args)
        else:
            evaluate(args)
    except (DataError, ModelLoadError, CliError) as e:
        fail(e, getattr(e, "exit_code", 2))
    except KeyboardInterrupt:
        sys.stderr.write("cat-fast: interrupted\n")
        raise SystemExit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _terminated(signum, frame):
    raise KeyboardInterrupt
