"""``cat-fast train``'s options."""
from __future__ import annotations

import argparse

from .arguments import SEED_MAX, add_column_options, method_names, scheduler_types, seed_int
from .common import DATA_MODES, nonneg_int, positive_int
from .train_data import add_requirement_options
from .train_objective import add_objective_options
from .trainer_args import add_trainer_args

__all__ = ["add_train"]


def add_train(sub, fmt) -> None:
    """Add the ``train`` command to the `cat-fast` subparsers `sub` (help formatter `fmt`)."""
    t = sub.add_parser("train", help="train a classifier", formatter_class=fmt,
                       description="Train a classifier (see `python -m pydoc cat_fast.cli`). Give --task for the "
                                   "built-in CAD data, or --train FILE with --text-column and --label-column. The "
                                   "Trainer's other TrainingArguments fields go last, after --trainer-args.")
    t.add_argument("--task", choices=("sentiment", "nli"),
                   help="built-in CAD data (and CAD-format --train files): a preset of the columns and labels")
    t.add_argument("--method", required=True, choices=method_names(), help="the objective (cat_fast.objectives registry)")
    t.add_argument("--train", "--train_file", nargs="+", metavar="FILE", help="training data (default with --task: the built-in CAD "
                   "train split; CAD sentiment: a paired file with batch_id or plain files; CAD nli: originals, then "
                   "revised files paired by position; your own data: one file or directory)")
    t.add_argument("--dev", metavar="FILE", help="dev file scored after every epoch as 'dev' (default with --task: "
                   "the built-in CAD dev set, also scored as dev_orig and dev_edit)")
    t.add_argument("--eval", nargs="+", action="extend", metavar="NAME=FILE", default=[],
                   help="extra evaluation sets, scored at the end")
    add_column_options(t)
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
    t.add_argument("--lr-scheduler-type", default="linear", choices=scheduler_types(),
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
    t.add_argument("--seed", type=seed_int, default=0, help="seed of the head's initialisation, the batches and the draws "
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
                        "the run allows it (no --grad-accum, a method whose steps can be replayed; under torchrun the "
                        "all-reduce is part of the graph), else the eager step with one line saying why; "
                        "--step-graphs requires it (an error naming what prevents it: --grad-accum, a second "
                        "optimizer step inside the step "
                        "as in erm-two-step and CAT's alternating update); --no-step-graphs turns it off")
    t.add_argument("--ddp-bucket-mb", type=positive_int, metavar="MB",
                   help="under torchrun: the size of DistributedDataParallel's gradient buckets (default: PyTorch's "
                        "25). Larger buckets start the all-reduce later in the backward (benchmarks/RESULTS.md has "
                        "the measured scaling)")
    t.add_argument("--out", "--output_dir", metavar="DIR", help="output directory (default: runs/TASK-METHOD-seedN)")
    t.add_argument("--overwrite", action="store_true", help="replace an existing --out that cat-fast wrote")
    t.add_argument("--no-checkpoint", action="store_true",
                   help="write metrics and curves but not the model weights (for seed sweeps)")
    _add_run_options(t)
    w = t.add_argument_group("warm-up")
    w.add_argument("--warmup-epochs", type=nonneg_int, default=1, help="methods with an ERM warm-up (cat, cat-star, "
                   "cat-gs, erm-two-step, and any registered with warmup=True): plain ERM epochs first")
    add_objective_options(t)  # the objectives' flags, from their configs (plugins included)
    add_requirement_options(t)  # the data each requirement kind needs (bias file, teacher, metadata set)


def _add_run_options(t) -> None:
    """LoRA, checkpoints and logs."""
    lo = t.add_argument_group("LoRA (peft: pip install 'cat_fast[lora]')")
    lo.add_argument("--lora", type=positive_int, metavar="R", help="train LoRA adapters of rank R on the encoder's "
                    "projections and the classification head, the rest frozen; the checkpoint holds the merged model. "
                    "The fast layers run the adapted projections as W + scaling * B @ A (with --lora-dropout 0; "
                    "otherwise the model's own layers run, and a warning says why)")
    lo.add_argument("--lora-alpha", type=float, metavar="A", help="LoRA scaling numerator (default: 2 x R)")
    lo.add_argument("--lora-dropout", type=float, default=0.0,
                    help="dropout on the LoRA branch's input (above 0 the model's own layers run)")
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
    add_trainer_args(t.add_argument_group("the Trainer's other settings"))
