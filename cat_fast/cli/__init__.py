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
import math
import signal
import sys
from typing import Optional, Sequence

from .common import DATA_MODES, CliError, Parser, fail, float_pair, int_list, nonneg_int, positive_int

__all__ = ["main", "build_parser", "CliError"]


def _scheduler_types():
    from transformers.trainer_utils import SchedulerType

    return [t.value for t in SchedulerType if t.value not in ("reduce_lr_on_plateau", "greedy")]


def _methods():
    from ..objectives import names  # imports torch and transformers: only when the parser is built

    return names()


def _columns(parser) -> None:
    c = parser.add_argument_group("your own data", "Instead of --task: CSV, TSV, JSON Lines or a JSON array, a "
                                  "save_to_disk directory or a local Hugging Face dataset; PATH@SPLIT chooses a split. "
                                  "Columns not given are found by name: text / sentence / review, sentence1 + "
                                  "sentence2, premise + hypothesis, question + sentence; label / labels.")
    c.add_argument("--text-column", metavar="NAME", help="column of the text (the premise for text pairs)")
    c.add_argument("--text-pair-column", metavar="NAME", help="column of the second text of a pair (the hypothesis)")
    c.add_argument("--label-column", metavar="NAME", help="column of the label (strings or integers)")
    c.add_argument("--group-column", metavar="NAME", help="rows with the same value are counterfactuals of each other "
                   "(the first in the file is the original); needed by gs and gs-random")
    c.add_argument("--id-column", metavar="NAME", help="column of an example id (default: the row number)")
    c.add_argument("--labels", type=_names, metavar="A,B,...", help="the label set, in id order (default: every label "
                   "in the training file, integers in numeric order, names in alphabetical order)")


def _names(s: str):
    names = [x.strip() for x in s.split(",") if x.strip()]
    if len(names) < 2 or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected at least two distinct comma-separated labels, got {s!r}")
    return names


SEED_MAX = 2**32 - 1  # numpy's seeds (the Trainer seeds numpy with --seed)


def _seed(s: str) -> int:
    try:
        value = int(s)
    except ValueError:
        value = -1
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, {SEED_MAX}], got {s!r}")
    return value


def _positive_float(s: str) -> float:
    try:
        value = float(s)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {s!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = Parser(prog="cat-fast", formatter_class=fmt,
               description="Train and evaluate text classifiers with counterfactual and debiasing objectives (CAT, "
                           "gradient supervision) on the built-in CAD data or your own files.")
    p.add_argument("--version", action="version", version=f"cat-fast {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{train,eval,predict,bias,mediation,mask,unlearn}",
                           parser_class=Parser)
    sub.required = True

    t = sub.add_parser("train", help="train a classifier", formatter_class=fmt,
                       description="Train a classifier (see `python -m pydoc cat_fast.cli`). Give --task for the "
                                   "built-in CAD data, or --train FILE with --text-column and --label-column.")
    t.add_argument("--task", choices=("sentiment", "nli"),
                   help="built-in CAD data (and CAD-format --train files): a preset of the columns and labels")
    t.add_argument("--method", required=True, choices=_methods(), help="the objective (cat_fast.objectives registry)")
    t.add_argument("--train", "--train_file", nargs="+", metavar="FILE", help="training data (default with --task: the built-in CAD "
                   "train split; CAD sentiment: a paired file with batch_id or plain files; CAD nli: originals, then "
                   "revised files paired by position; your own data: one file or directory)")
    t.add_argument("--dev", metavar="FILE", help="dev file scored after every epoch as 'dev' (default with --task: "
                   "the built-in CAD dev set, also scored as dev_orig and dev_edit)")
    t.add_argument("--eval", nargs="+", action="extend", metavar="NAME=FILE", default=[],
                   help="extra evaluation sets, scored at the end")
    _columns(t)
    t.add_argument("--data", choices=DATA_MODES, help="training data: originals only or originals + edits "
                   "(default: the method's: erm-orig originals, the others originals + edits)")
    t.add_argument("--model", "--model_name_or_path", default="minilm", help="model directory, a hub name cached locally (org/name[@revision]; "
                   "nothing is downloaded), or 'minilm' (the shipped all-MiniLM-L6-v2)")
    t.add_argument("--epochs", "--num_train_epochs", type=positive_int, default=3, help="training epochs")
    t.add_argument("--batch-size", "--per_device_train_batch_size", type=positive_int, default=8,
                   help="examples per batch (per rank under torchrun: a step sees N x this many)")
    t.add_argument("--grad-accum", type=positive_int, default=1, help="batches per optimizer step (gradient accumulation)")
    t.add_argument("--lr", "--learning_rate", type=float, default=5e-5, help="AdamW learning rate (linear decay to 0)")
    t.add_argument("--weight-decay", "--weight_decay", type=float, default=0.01, help="AdamW weight decay (not on biases and norms)")
    t.add_argument("--lr-warmup-ratio", type=float, default=0.0, help="fraction of the steps with a linear lr warm-up")
    t.add_argument("--warmup-steps", type=nonneg_int, metavar="N", help="optimizer steps of the lr warm-up (instead "
                   "of --lr-warmup-ratio)")
    t.add_argument("--lr-scheduler-type", default="linear", choices=_scheduler_types(),
                   help="the Trainer's learning-rate schedule after the warm-up")
    t.add_argument("--optim", default="adamw_torch", metavar="NAME", help="the Trainer's optimizer "
                   "(TrainingArguments.optim: adamw_torch, adamw_torch_fused, sgd, adafactor, ...); the captured step "
                   "(--step-graphs) needs an AdamW")
    t.add_argument("--max-grad-norm", "--max_grad_norm", type=float, default=1.0, help="gradient clipping (0 = off)")
    t.add_argument("--max-length", type=positive_int, default=128, help="tokens per example (truncation)")
    t.add_argument("--label-noise", type=float, metavar="P", help="replace a fraction P of the training labels by "
                   "another class drawn at random (seeded by --seed; the noisy-label scenario)")
    t.add_argument("--long-tail", metavar="LABEL=FRACTION", help="keep only FRACTION of the training examples of "
                   "class LABEL (seeded by --seed; the long-tail scenario)")
    t.add_argument("--per-class", type=positive_int, metavar="K", help="few-shot: K original examples per class (+ "
                   "their edits)")
    t.add_argument("--seed", type=_seed, default=0, help="seed of the head's initialisation, the batches and the draws "
                   f"(0 to {SEED_MAX})")
    t.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    t.add_argument("--bf16", action="store_true", help="bfloat16 mixed precision")
    t.add_argument("--attn", default="auto", choices=("auto", "eager", "sdpa"),
                   help="attention implementation; auto = eager for gs, gs-random and cat-gs (exact double "
                        "backward), else the model's default")
    t.add_argument("--eval-batch-size", type=positive_int, default=64, help="examples per evaluation batch")
    t.add_argument("--pad", default="auto", choices=("auto", "longest", "buckets"),
                   help="padding of the training batches: longest = to the batch's longest sequence; buckets = to "
                        "the next of a few lengths (32, 64, 96, 128, 192, 256, ... up to --max-length), so that CUDA "
                        "graphs see a handful of shapes; auto = buckets on a GPU, longest on the CPU")
    t.add_argument("--step-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="each training step (loss, backward, clipping, a fused AdamW step) as one CUDA graph per "
                        "batch shape and CAT mixing layer (cat_fast.step.CapturedStep). Default: on a GPU wherever "
                        "the run allows it (one process, no --grad-accum, a method whose steps can be replayed), "
                        "else the eager step with one line saying why; --step-graphs requires it (an error naming "
                        "what prevents it: several processes, --grad-accum, a second optimizer step inside the step "
                        "as in erm-two-step and CAT's alternating update); --no-step-graphs turns it off")
    t.add_argument("--ddp-bucket-mb", type=positive_int, metavar="MB",
                   help="under torchrun: the size of DistributedDataParallel's gradient buckets (default: PyTorch's "
                        "25). Larger buckets start the all-reduce later in the backward; on 2 H200s CAT scaled "
                        "1.98x with 200 against 1.92x (benchmarks/RESULTS.md, run AX)")
    t.add_argument("--out", "--output_dir", metavar="DIR", help="output directory (default: runs/TASK-METHOD-seedN)")
    t.add_argument("--overwrite", action="store_true", help="replace an existing --out that cat-fast wrote")
    t.add_argument("--no-checkpoint", action="store_true",
                   help="write metrics and curves but not the model weights (for seed sweeps)")
    lo = t.add_argument_group("LoRA (peft: pip install 'cat_fast[lora]')")
    lo.add_argument("--lora", type=positive_int, metavar="R", help="train LoRA adapters of rank R on the encoder's "
                    "projections and the classification head, the rest frozen; the checkpoint holds the merged model. "
                    "The fast layers do not run adapter-wrapped projections (a warning says so)")
    lo.add_argument("--lora-alpha", type=float, metavar="A", help="LoRA scaling numerator (default: 2 x R)")
    lo.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the LoRA branch's input")
    lo.add_argument("--lora-target-modules", metavar="NAME,...", help="the projections to adapt (default: peft's "
                    "for the model type, e.g. query,value for BERT)")
    r = t.add_argument_group("checkpoints and logs")
    r.add_argument("--save-steps", type=nonneg_int, default=0, help="write a resumable checkpoint every N optimizer "
                   "steps to DIR.checkpoints (0 = none; removed when the run completes unless --keep-checkpoints)")
    r.add_argument("--save-total-limit", type=positive_int, default=2, help="checkpoints kept in DIR.checkpoints")
    r.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in "
                   "DIR.checkpoints (the same options and data: a difference is refused, naming it)")
    r.add_argument("--keep-checkpoints", action="store_true", help="keep DIR.checkpoints when the run completes "
                   "(the newest --save-total-limit of them); default: removed")
    r.add_argument("--eval-steps", type=positive_int, metavar="N", help="also score the dev set every N optimizer "
                   "steps (default: at the end of each epoch only)")
    r.add_argument("--keep-best", action="store_true", help="the final model is the one with the best dev accuracy "
                   "among the evaluations (epoch ends and --eval-steps), not the last one")
    r.add_argument("--early-stopping-patience", type=positive_int, metavar="N", help="stop when the dev accuracy "
                   "has not improved for N evaluations")
    r.add_argument("--dev-split", choices=("all", "tune", "report"), default="all",
                   help="score on half of the built-in CAD dev set: tune (for choosing hyper-parameters) or report "
                   "(for the chosen configuration), split by counterfactual group with a fixed seed; default all")
    r.add_argument("--logging-steps", type=positive_int, default=1, help="optimizer steps per logged point "
                   "(losses and the objective's terms are averaged over them)")
    r.add_argument("--report-to", nargs="+", metavar="NAME", help="logging integrations of the Hugging Face Trainer "
                   "(tensorboard, wandb, ... where installed)")
    g = t.add_argument_group("CAT / GS")
    g.add_argument("--warmup-epochs", type=nonneg_int, default=1, help="CAT methods: plain ERM epochs first")
    g.add_argument("--cat-layers", type=int_list, metavar="M,M,...", help="CAT mixing layers Q (default: the paper's "
                   "{8,9,10} of 12 scaled to the model's depth)")
    g.add_argument("--alpha", type=float, default=0.3, help="CAT: λ ~ Beta(alpha, beta)")
    g.add_argument("--beta", type=float, default=0.3, help="CAT: λ ~ Beta(alpha, beta)")
    g.add_argument("--gamma", type=float, default=10.0, help="CAT: weight of the CE term of the CAL objective")
    g.add_argument("--eta", type=float, default=20.0, help="CAT: weight of the max-probability term of the CAL "
                   "objective")
    g.add_argument("--adv-steps", type=nonneg_int, help="CAL steps (default: 3 for cat and cat-gs, 0 for cat-star)")
    g.add_argument("--adv-lr", type=float, default=2e-2, help="CAL step size on λ")
    g.add_argument("--mask-mode", default="self", choices=("self", "partner", "union", "intersection"),
                   help="CAT: attention mask of the mixed sequence")
    g.add_argument("--cat-update", choices=("sum", "alternate"), default="sum",
                   help="CAT update: one summed ERM + CRM loss, or the paper's alternating CRM then ERM steps")
    g.add_argument("--crm-lr", type=float, default=2e-5, help="learning rate of the CRM step with --cat-update "
                   "alternate")
    g.add_argument("--gs-weight", type=float, default=1.0, help="weight of the GS loss (gs, gs-random, cat-gs)")
    g.add_argument("--crm-clip", type=float_pair, metavar="A1,A2", help="CAT: clip range [A1, A2] of the CRM weight ω "
                   "(default 0,10, the paper's main text; its appendix searches within [0.9, 2])")
    g.add_argument("--gs-representation", default="pooled", metavar="pooled|K",
                   help="GS (gs, gs-random): where the input gradient is taken: pooled (the classification layer's "
                   "input) or K, the token states after layer K (0 = the embedding output; pairs aligned by position)")
    g.add_argument("--gs-mode", choices=("exact", "first_order"), default="exact",
                   help="GS: exact (double backward; eager attention) or first_order (finite differences, any attention)")
    g.add_argument("--gs-difference", choices=("central", "forward"), default="central",
                   help="GS first_order: central (two perturbed passes) or forward (one) differences")
    b = t.add_argument_group("bias-model methods (poe, reweight, reweight-inverse, learned-mixin, conf-reg)")
    b.add_argument("--bias", metavar="FILE", help="the bias model's predictions for the training examples (written by "
                   "`cat-fast bias fit`; rows matched by example id)")
    b.add_argument("--teacher", metavar="DIR", help="conf-reg: a trained classifier whose probabilities are the "
                   "targets")
    b.add_argument("--entropy-weight", type=float, default=0.03, help="learned-mixin: weight of the entropy penalty")

    m = t.add_argument_group("causal logit perturbation (clp, clp-all)")
    m.add_argument("--meta-data", metavar="FILE", help="the metadata set (your own file, read with the column "
                   "options; default with a CAD task: a balanced draw from the built-in dev set with its edits, "
                   "which the dev score then leaves out)")
    m.add_argument("--meta-per-class", type=positive_int, default=10, help="originals per class drawn (with their "
                   "edits) for the built-in metadata")
    m.add_argument("--meta-holdout", action="store_true", help="any method: score dev without the groups of the "
                   "built-in metadata draw (--meta-per-class, --seed), as clp does, so the two compare on one set")
    m.add_argument("--meta-batch-size", type=positive_int, default=32, help="metadata examples per meta step")
    m.add_argument("--meta-lr", type=float, default=1e-3, help="Adam learning rate of the perturbation network")
    m.add_argument("--clp-scale", type=float, default=1.0, help="the perturbation's bound (tanh times this)")
    m.add_argument("--virtual-lr", type=float, help="step size of the virtual SGD step (default: the optimizer's "
                   "current learning rate, which for AdamW is a much smaller step than the real one)")

    bias = sub.add_parser("bias", help="bias models for the bias-model methods", formatter_class=fmt,
                          description="Bias models (see `python -m pydoc cat_fast.cli.bias`).")
    bsub = bias.add_subparsers(dest="bias_command", metavar="{fit}", parser_class=Parser)
    bsub.required = True
    f = bsub.add_parser("fit", help="write a bias model's predictions for the training examples", formatter_class=fmt,
                        description="Fit a bias model on the training data and write its per-example "
                                    "log-probabilities to DIR/bias.jsonl (for train --bias DIR).")
    f.add_argument("--kind", required=True, choices=("overlap", "column"),
                   help="overlap: word-overlap features + logistic regression (NLI); column: a classifier trained on "
                        "one column (--model)")
    f.add_argument("--task", choices=("sentiment", "nli"), help="built-in CAD data (or CAD-format --train files)")
    f.add_argument("--train", nargs="+", metavar="FILE", help="training data (default with --task: the built-in "
                   "CAD train split)")
    _columns(f)
    f.add_argument("--model", metavar="DIR", help="--kind column: the classifier trained on that column")
    f.add_argument("--column", default="text_pair", help="--kind column: the column it reads (text, text_pair or a "
                   "column name)")
    f.add_argument("--C", type=_positive_float, default=100.0, help="--kind overlap: inverse L2 strength (Clark's C; "
                   "a finite number > 0)")
    f.add_argument("--batch-size", type=positive_int, default=64, help="--kind column: examples per batch")
    f.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    f.add_argument("--out", required=True, metavar="DIR", help="output directory (bias.jsonl, bias_meta.json)")
    f.add_argument("--overwrite", action="store_true", help="replace an existing --out that cat-fast wrote")

    e = sub.add_parser("eval", help="evaluate a trained classifier", formatter_class=fmt,
                       description="Evaluate a checkpoint written by `cat-fast train`.")
    e.add_argument("--model", required=True, metavar="DIR", help="a checkpoint directory")
    e.add_argument("--task", choices=("sentiment", "nli"), help="default: the data the checkpoint was trained on")
    e.add_argument("--eval", nargs="+", action="extend", metavar="NAME=FILE", default=[],
                   help="evaluation sets (with a CAD task the built-in dev set is always scored too, as dev, dev_orig, "
                   "dev_edit; `hans`: the shipped HANS-style set)")
    _columns(e)
    e.add_argument("--max-length", type=positive_int, help="default: the checkpoint's training max length, else 128")
    e.add_argument("--eval-batch-size", type=positive_int, default=64, help="examples per batch")
    e.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    e.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    e.add_argument("--out", metavar="DIR", help="write DIR/metrics.json (default: print JSON)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing --out that cat-fast wrote")
    pr = sub.add_parser("predict", help="every example's prediction and class probabilities", formatter_class=fmt,
                        description="Write a checkpoint's predicted label and class probabilities for every example "
                                    "of --data, with its gold label when the data has one (see `python -m pydoc "
                                    "cat_fast.cli.predict`).")
    pr.add_argument("--model", required=True, metavar="DIR", help="a checkpoint directory")
    pr.add_argument("--data", required=True, metavar="FILE", help="the examples, read as `cat-fast eval` reads "
                    "them (a label column is optional)")
    pr.add_argument("--task", choices=("sentiment", "nli"), help="CAD-format --data (default: the data the "
                    "checkpoint was trained on)")
    _columns(pr)
    pr.add_argument("--max-length", type=positive_int, help="default: the checkpoint's training max length, else 128")
    pr.add_argument("--eval-batch-size", type=positive_int, default=64, help="examples per batch")
    pr.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    pr.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    pr.add_argument("--out", required=True, metavar="FILE", help="FILE.csv (columns id, prediction, prob_LABEL..., "
                    "gold) or FILE.jsonl (id, prediction, probs, gold)")
    pr.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    md = sub.add_parser("mediation", help="the NIE of every neuron (causal mediation analysis)", formatter_class=fmt,
                        description="Causal mediation analysis of a trained NLI classifier's neurons (see `python -m "
                                    "pydoc cat_fast.cli.mediation`).")
    md.add_argument("--model", required=True, metavar="DIR", help="a trained classifier (cat-fast train --out DIR)")
    md.add_argument("--task", choices=("nli",), help="the built-in CAD NLI dev set as samples")
    md.add_argument("--samples", metavar="FILE", help="samples from your own file (with the column options)")
    _columns(md)
    md.add_argument("--per-class", type=positive_int, default=100, help="samples per class (class-balanced; more "
                    "than the samples hold of a class is refused)")
    md.add_argument("--treatment-quantile", type=float, default=0.95, help="treatment: pairs at or above this "
                    "quantile of hypothesis-word overlap")
    md.add_argument("--target-class", default="entailment", help="label name or index whose probability is mediated")
    md.add_argument("--method", choices=("exact", "first-order"), default="exact",
                    help="exact batched sweep, or the first-order estimate (one backward)")
    md.add_argument("--layers", type=positive_int, nargs="+", help="layers to sweep (default: all)")
    md.add_argument("--components", nargs="+", help="components to sweep (default: all six)")
    md.add_argument("--top-k", type=positive_int, help="top neurons listed (default: 700 of 82,944, scaled)")
    md.add_argument("--max-length", type=positive_int, default=128, help="tokens per pair (truncation)")
    md.add_argument("--seed", type=_seed, default=0, help=f"seed of the class-balanced draws (0 to {SEED_MAX})")
    md.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    md.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    md.add_argument("--out", required=True, metavar="DIR", help="output directory (nie.pt, nie_summary.tsv, "
                    "top_neurons.tsv, top_neurons.png, mediation.json)")
    md.add_argument("--overwrite", action="store_true", help="replace an existing --out that cat-fast wrote")

    mk = sub.add_parser("mask", help="mask the top neurons of a mediation analysis", formatter_class=fmt,
                        description="Write a copy of --model with the top neurons of --nie masked at the first token "
                                    "(load it with cat_fast.analysis.masking.load_masked; cat-fast eval applies it).")
    mk.add_argument("--model", required=True, metavar="DIR", help="the classifier the analysis was run on")
    mk.add_argument("--nie", required=True, metavar="DIR", help="a cat-fast mediation output (or its nie.pt)")
    mk.add_argument("--top-k", type=positive_int, help="neurons to mask (default: the analysis' top-k)")
    mk.add_argument("--factor", type=float, default=0.0, help="activation scale in [0, 1] (0: hard mask)")
    mk.add_argument("--random-neurons", action="store_true", help="the paper's control: --top-k neurons drawn at "
                    "random (with --seed) instead of the top ones")
    mk.add_argument("--seed", type=_seed, default=0, help=f"seed of --random-neurons (0 to {SEED_MAX})")
    mk.add_argument("--rescale", action="store_true", help="the paper's inverted-dropout form: the component's other "
                    "first-token activations times 1/p (p: the fraction left unmasked)")
    mk.add_argument("--out", required=True, metavar="DIR", help="output model directory")
    mk.add_argument("--overwrite", action="store_true", help="replace an existing --out that cat-fast wrote")

    ul = sub.add_parser("unlearn", help="gradient unlearning of the top neurons of a mediation analysis",
                        formatter_class=fmt, description="Train only the weight rows producing the top neurons of "
                        "--nie, with the gradient reversed, on the advantaged training examples (--bias right, the "
                        "model wrong); every other parameter stays bit-identical. Writes a model directory.")
    ul.add_argument("--model", required=True, metavar="DIR", help="the classifier the analysis was run on")
    ul.add_argument("--nie", required=True, metavar="DIR", help="a cat-fast mediation output (or its nie.pt)")
    ul.add_argument("--task", choices=("sentiment", "nli"), help="built-in CAD training data")
    ul.add_argument("--train", nargs="+", metavar="FILE", help="training data (default with --task: built-in)")
    _columns(ul)
    ul.add_argument("--bias", required=True, metavar="FILE", help="the bias model's predictions (cat-fast bias fit)")
    ul.add_argument("--top-k", type=positive_int, help="neurons to unlearn (default: the analysis' top-k)")
    ul.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate of the ascent steps")
    ul.add_argument("--epochs", type=positive_int, default=15, help="passes over the training data (released code: 15)")
    ul.add_argument("--batch-size", type=positive_int, default=32, help="examples per batch (released code: 32)")
    ul.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (released code: 0.1)")
    ul.add_argument("--examples", choices=("advantaged", "random", "all"), default="advantaged",
                    help="advantaged: the bias model right and the model wrong (chosen once, before the first step); "
                    "random: as many examples drawn at random (the paper's control); all: every example")
    ul.add_argument("--random-neurons", action="store_true", help="the paper's control: --top-k neurons drawn at "
                    "random (with --seed) instead of the top ones")
    ul.add_argument("--candidate-class", metavar="LABEL", help="advantaged examples of this gold class only (the "
                    "released code: entailment for NLI); default: every class (the paper's text)")
    ul.add_argument("--max-length", type=positive_int, default=128, help="tokens per example (truncation)")
    ul.add_argument("--seed", type=_seed, default=0, help=f"seed of the batch order and of the random draws (0 to "
                    f"{SEED_MAX})")
    ul.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    ul.add_argument("--out", required=True, metavar="DIR", help="output model directory")
    ul.add_argument("--overwrite", action="store_true", help="replace an existing --out that cat-fast wrote")
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
