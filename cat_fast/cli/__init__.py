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
import sys
from typing import Optional, Sequence

from .common import DATA_MODES, CliError, Parser, fail, int_list, nonneg_int, positive_int

__all__ = ["main", "build_parser", "CliError"]


def _methods():
    from ..objectives import names  # imports torch and transformers: only when the parser is built

    return names()


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="cat-fast", description="Train and evaluate text classifiers with counterfactual methods (CAT, GS) on CAD data.")
    sub = p.add_subparsers(dest="command", metavar="{train,eval}", parser_class=Parser)
    sub.required = True

    t = sub.add_parser("train", help="train a classifier", description="Train a classifier (see `python -m pydoc cat_fast.cli`).")
    t.add_argument("--task", required=True, choices=("sentiment", "nli"))
    t.add_argument("--method", required=True, choices=_methods())
    t.add_argument("--train", nargs="+", metavar="FILE", help="training files (default: the built-in CAD train split). "
                   "sentiment: a paired file (with batch_id) or plain files; nli: originals, then revised files paired by position")
    t.add_argument("--dev", metavar="FILE", help="dev file evaluated after every epoch as 'dev' (default: the built-in CAD dev set)")
    t.add_argument("--eval", nargs="+", action="extend", metavar="NAME=FILE", default=[], help="extra evaluation sets")
    t.add_argument("--data", choices=DATA_MODES, help="training data: originals only or originals + edits (default: by method)")
    t.add_argument("--model", default="minilm", help="model directory, or 'minilm' (default)")
    t.add_argument("--epochs", type=positive_int, default=3)
    t.add_argument("--batch-size", type=positive_int, default=8)
    t.add_argument("--lr", type=float, default=5e-5)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--lr-warmup-ratio", type=float, default=0.0, help="fraction of steps with linear lr warm-up (default 0)")
    t.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0 = off)")
    t.add_argument("--max-length", type=positive_int, default=128)
    t.add_argument("--per-class", type=positive_int, metavar="K", help="few-shot: K original examples per class (+ their edits)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    t.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    t.add_argument("--attn", default="auto", choices=("auto", "eager", "sdpa"),
                   help="attention implementation; auto = eager for gs, gs-random and cat-gs (exact double backward), else the default")
    t.add_argument("--eval-batch-size", type=positive_int, default=64)
    t.add_argument("--out", metavar="DIR", help="output directory (default: runs/TASK-METHOD-seedN)")
    t.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --out")
    t.add_argument("--no-checkpoint", action="store_true",
                   help="write metrics and curves but not the model weights (for seed sweeps)")
    g = t.add_argument_group("CAT / GS")
    g.add_argument("--warmup-epochs", type=nonneg_int, default=1, help="CAT methods: plain ERM epochs first (default 1)")
    g.add_argument("--cat-layers", type=int_list, metavar="M,M,...", help="CAT mixing layers Q (default: the objective's)")
    g.add_argument("--alpha", type=float, default=0.3)
    g.add_argument("--beta", type=float, default=0.3)
    g.add_argument("--gamma", type=float, default=10.0)
    g.add_argument("--eta", type=float, default=20.0)
    g.add_argument("--adv-steps", type=nonneg_int, help="CAL steps (default: 3 for cat and cat-gs, 0 for cat-star)")
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
    e.add_argument("--max-length", type=positive_int, help="default: the checkpoint's training max length, else 128")
    e.add_argument("--eval-batch-size", type=positive_int, default=64)
    e.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    e.add_argument("--bf16", action="store_true")
    e.add_argument("--out", metavar="DIR", help="write DIR/metrics.json (default: print JSON)")
    e.add_argument("--overwrite", action="store_true")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``cat-fast``; returns 0, or raises SystemExit(2) on bad input (one line on stderr)."""
    args = build_parser().parse_args(argv)
    from ..data import DataError
    from ..models.pretrained import ModelLoadError
    from .evaluate import evaluate
    from .train import train

    try:
        if args.command == "train":
            train(args)
        else:
            evaluate(args)
    except (DataError, ModelLoadError, CliError) as e:
        fail(e)
    except KeyboardInterrupt:
        sys.stderr.write("cat-fast: interrupted\n")
        raise SystemExit(130)
    return 0
