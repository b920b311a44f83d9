"""``cat-fast train --trainer-args --FIELD VALUE ...``: the Hugging Face `TrainingArguments` fields that cat-fast has
no option of its own for, parsed by `transformers.HfArgumentParser` itself (names, types, choices, booleans) and
checked by `TrainingArguments` (its ``__post_init__``), then given to the run's Trainer.

``--trainer-args`` takes the rest of the command line. Refused, one line each: a field cat-fast sets from one of its
own options (naming that option), and a field cat-fast must control (with the reason). The accepted fields are
recorded as ``trainer_args`` (field -> value, JSON) with the run's options: metrics.json's ``config`` and the
checkpoint folder's run record, which a ``--resume`` compares like any option.
"""
from __future__ import annotations

import argparse
import enum
import json
import math
import multiprocessing
from typing import Dict, List, Optional

from .common import CliError

__all__ = ["OWN", "CONTROLLED", "add_trainer_args", "resolve", "training_arguments", "loader_kwargs"]

# fields cat-fast sets from its own options: field -> the option
OWN = {
    "output_dir": "--out", "per_device_train_batch_size": "--batch-size", "num_train_epochs": "--epochs",
    "max_steps": "--epochs", "learning_rate": "--lr", "lr_scheduler_type": "--lr-scheduler-type",
    "warmup_steps": "--warmup-steps", "optim": "--optim", "weight_decay": "--weight-decay",
    "gradient_accumulation_steps": "--grad-accum", "max_grad_norm": "--max-grad-norm", "bf16": "--bf16",
    "logging_steps": "--logging-steps", "report_to": "--report-to", "eval_steps": "--eval-steps",
    "per_device_eval_batch_size": "--eval-batch-size", "save_steps": "--save-steps",
    "save_total_limit": "--save-total-limit", "load_best_model_at_end": "--keep-best", "seed": "--seed",
    "data_seed": "--seed", "use_cpu": "--device", "ddp_bucket_cap_mb": "--ddp-bucket-mb",
    "resume_from_checkpoint": "--resume",
}

_EVAL = ("cat-fast scores the dev and --eval sets itself (--eval-steps, --eval-batch-size); the Trainer's "
         "evaluation loop does not run")
_BATCHES = "cat-fast draws every epoch's batches up front (--batch-size, --seed; whole counterfactual groups)"
_OUTPUT = "cat-fast shows its own progress bar and one-line messages"
_HUB = "cat-fast writes the model to --out and uploads nothing"
_PARALLEL = "the objectives run under DistributedDataParallel only (torchrun), not FSDP, DeepSpeed or others"
_GROUP = "cat-fast starts the process group itself (cat_fast.distributed)"

# fields cat-fast must control: field -> why
CONTROLLED = {
    "remove_unused_columns": "the batches carry the objective's columns (pairs, groups, the requirements' "
                             "per-example columns), which the Trainer must keep",
    "save_strategy": "checkpoints are written every --save-steps N optimizer steps",
    "save_only_model": "a --resume needs the optimizer's and the scheduler's state in each checkpoint",
    "enable_jit_checkpoint": "cat-fast's checkpoints are written atomically (--save-steps) and kept on an interrupt",
    "restore_callback_states_from_checkpoint": "a --resume restores cat-fast's dev evaluations itself",
    "ignore_data_skip": "a --resume continues with the batches an uninterrupted run sees",
    "logging_strategy": "cat-fast logs every --logging-steps steps and summarises each epoch from those logs",
    "log_level": _OUTPUT, "log_level_replica": _OUTPUT, "disable_tqdm": _OUTPUT,
    "eval_strategy": _EVAL, "eval_delay": _EVAL, "eval_on_start": _EVAL, "eval_do_concat_batches": _EVAL,
    "eval_use_gather_object": _EVAL, "eval_accumulation_steps": _EVAL, "prediction_loss_only": _EVAL,
    "include_for_metrics": _EVAL, "batch_eval_metrics": _EVAL, "bf16_full_eval": _EVAL, "fp16_full_eval": _EVAL,
    "metric_for_best_model": "--keep-best keeps the model of the best dev accuracy",
    "greater_is_better": "--keep-best keeps the model of the best dev accuracy",
    "label_smoothing_factor": "the objective computes the training loss; the Trainer's label smoothing would not "
                              "apply",
    "label_names": "cat-fast's batches hold the labels as 'labels'",
    "dataloader_drop_last": _BATCHES, "train_sampling_strategy": _BATCHES, "length_column_name": _BATCHES,
    "auto_find_batch_size": _BATCHES,
    "accelerator_config": "cat-fast deals whole batches out to the ranks itself",
    "dataloader_multiprocessing_context": "the training loader forks its workers (the batch stream is local to "
                                          "the run)",
    "fsdp": _PARALLEL, "fsdp_config": _PARALLEL, "deepspeed": _PARALLEL, "parallelism_config": _PARALLEL,
    "ddp_find_unused_parameters": "set from the objective (whether its steps leave parameters unused)",
    "ddp_backend": _GROUP, "ddp_timeout": _GROUP, "local_rank": "torchrun sets it",
    "do_train": "a script's switch the Trainer does not read", "do_eval": "a script's switch the Trainer does not read",
    "do_predict": "a script's switch the Trainer does not read",
    "push_to_hub": _HUB, "hub_token": _HUB, "hub_private_repo": _HUB, "hub_model_id": _HUB, "hub_strategy": _HUB,
    "hub_always_push": _HUB, "hub_revision": _HUB,
}

HELP = ("the Hugging Face Trainer's other settings: every transformers.TrainingArguments field cat-fast has no "
        "option for, as --FIELD VALUE (e.g. --trainer-args --adam_beta2 0.98 --lr_scheduler_kwargs '{\"power\": 2}' "
        "--dataloader_num_workers 2), parsed and checked by transformers.HfArgumentParser. It takes the rest of the "
        "command line: give cat-fast's own options before it. A field set by a cat-fast option (--lr, --optim, "
        "--seed, ...) or controlled by cat-fast (save_strategy, remove_unused_columns, ...) is refused, naming the "
        "option or the reason. Saved as trainer_args in metrics.json's config (a --resume needs the same). "
        "--trainer-args --help lists the fields")


class _TrainerArgs(argparse.Action):
    """Stores the tokens after ``--trainer-args``; ``--trainer-args --help`` prints the fields and exits."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values and values[0] in ("-h", "--help"):
            fields = _parser()
            for action in fields._actions:  # the fields cat-fast sets or controls: not listed
                if action.dest in OWN or action.dest in CONTROLLED:
                    action.help = argparse.SUPPRESS
            fields.print_help()
            parser.exit()
        setattr(namespace, self.dest, list(values))


def add_trainer_args(group) -> None:
    """The ``--trainer-args`` option, into the argument group (or parser) `group`."""
    group.add_argument("--trainer-args", nargs=argparse.REMAINDER, action=_TrainerArgs, metavar="--FIELD VALUE",
                       help=HELP)


def _parser():
    from transformers import HfArgumentParser, TrainingArguments

    class Parser(HfArgumentParser):
        def error(self, message):
            raise CliError(f"--trainer-args: {message}")

    return Parser(TrainingArguments, prog="cat-fast train ... --trainer-args", allow_abbrev=False)


def _parse(tokens: List[str]) -> Dict:
    """The fields given in `tokens` (HfArgumentParser's values), refused ones and unknown names as CliError."""
    parser = _parser()
    for action in parser._actions:  # only the given fields come back
        action.default = argparse.SUPPRESS
    namespace, rest = parser.parse_known_args(tokens)
    if rest:
        bad = rest[0]
        if bad.startswith("-"):
            raise CliError(f"--trainer-args: {bad.split('=')[0]} is not a field of transformers.TrainingArguments "
                           "(--trainer-args takes the rest of the command line: give cat-fast's own options "
                           "before it)")
        raise CliError(f"--trainer-args: unexpected value {bad!r} (expected --FIELD VALUE ...)")
    fields = vars(namespace)
    order = {t.lstrip("-").split("=")[0].replace("-", "_"): i for i, t in reversed(list(enumerate(tokens)))}
    for name in sorted(fields, key=lambda n: (order.get(n, len(tokens)), n)):  # the first given first
        if name in OWN:
            raise CliError(f"--trainer-args --{name}: cat-fast sets it from {OWN[name]}; give {OWN[name]} (before "
                           "--trainer-args) instead")
        if name in CONTROLLED:
            raise CliError(f"--trainer-args --{name}: cat-fast controls it: {CONTROLLED[name]}")
    return fields


def _plain(value):
    """`value` as JSON: enum members as their values, tuples as lists."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _short(value) -> str:
    s = json.dumps(_plain(value)) if isinstance(value, (dict, list)) else str(value)
    return s if len(s) <= 60 else s[:57] + "..."


def _construct(kwargs: Dict, names: List[str], fields: Dict):
    from transformers import TrainingArguments

    try:
        return TrainingArguments(**kwargs)
    except Exception as error:  # TrainingArguments' checks (ValueError mostly, JSON errors, missing packages)
        given = " ".join(f"--{n} {_short(fields[n])}" for n in names)
        reason = " ".join(str(error).split()) or type(error).__name__
        raise CliError(f"--trainer-args {given}: {reason[:300]}") from None


def resolve(tokens: Optional[List[str]], args, device, world: int) -> Optional[Dict]:
    """The fields of ``--trainer-args`` (`tokens`) as field -> JSON value, each checked by `TrainingArguments` with
    cat-fast's own settings (one at a time, so that an error names its field, then together); None without it.
    Call after the process group is set up (`TrainingArguments` sets up accelerate's state)."""
    if tokens is None:
        return None
    if not tokens:
        raise CliError("--trainer-args: expected TrainingArguments fields after it (--FIELD VALUE ...)")
    from ..models.pretrained import quiet_transformers

    fields = _parse(tokens)
    for name, value in fields.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise CliError(f"--trainer-args --{name}: expected a finite number, got {value}")
    own = own_fields(args, "cat-fast-check", 1, 0, None, world, device)  # not created: a check only
    with quiet_transformers():  # its notes are said again when the run's own TrainingArguments are made
        for name in fields:
            made = _construct({**own, name: fields[name]}, [name], fields)
            now = getattr(made, name, None)
            if isinstance(fields[name], str) and isinstance(now, dict):  # a JSON dict field: recorded as the dict
                fields[name] = now
        _check_optimizer_and_schedule(_construct({**own, **fields}, list(fields), fields), fields)
    if fields.get("use_liger_kernel"):
        from transformers.utils import is_liger_kernel_available

        if not is_liger_kernel_available():
            raise CliError("--trainer-args --use_liger_kernel: needs the liger-kernel package (pip install liger-kernel)")
    workers = fields.get("dataloader_num_workers", 0)
    for name in ("dataloader_persistent_workers", "dataloader_prefetch_factor"):
        if fields.get(name) and not workers:
            raise CliError(f"--trainer-args --{name}: needs --dataloader_num_workers above 0 (the training loader's "
                           "worker processes)")
    return {name: _plain(value) for name, value in fields.items()}


def _check_optimizer_and_schedule(made, fields: Dict) -> None:
    """The fields read only when training starts: the optimizer's (``adam_*``, ``optim_*``: the optimizer is built on
    one CPU parameter, so that its own checks run now) and the schedule's (``lr_scheduler_kwargs``)."""
    import torch
    from transformers import Trainer, get_scheduler

    names = [n for n in fields if n.startswith(("adam_", "optim_"))]
    try:
        if names:
            optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(made)
            if getattr(optimizer_cls, "__module__", "").startswith("torch.optim"):  # fused or not: the same checks
                kwargs = {k: v for k, v in kwargs.items() if k != "fused"}
                optimizer_cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
        if "lr_scheduler_kwargs" in fields:
            names = ["lr_scheduler_kwargs"]
            one = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
            get_scheduler(made.lr_scheduler_type, one, num_warmup_steps=0, num_training_steps=2,
                          scheduler_specific_kwargs=made.lr_scheduler_kwargs)
    except Exception as error:  # the optimizer's or the schedule's own check
        given = " ".join(f"--{n} {_short(fields[n])}" for n in names)
        reason = " ".join(str(error).split()) or type(error).__name__
        kind = getattr(made.lr_scheduler_type, "value", made.lr_scheduler_type)
        where = f" (with --lr-scheduler-type {kind})" if names == ["lr_scheduler_kwargs"] else ""
        raise CliError(f"--trainer-args {given}{where}: {reason[:300]}") from None


def own_fields(args, output_dir, total_steps, lr_warm, find_unused, world, device) -> Dict:
    """The `TrainingArguments` fields cat-fast sets from its own options (`OWN`, and those it controls)."""
    saving = args.save_steps > 0
    return dict(
        output_dir=output_dir, max_steps=total_steps, num_train_epochs=1,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
        max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else 0.0,
        learning_rate=args.lr, weight_decay=args.weight_decay, lr_scheduler_type=args.lr_scheduler_type,
        warmup_steps=lr_warm, optim=args.optim,
        logging_steps=args.logging_steps, save_strategy="steps" if saving else "no",
        save_steps=args.save_steps if saving else 500, save_total_limit=args.save_total_limit,
        seed=args.seed, data_seed=args.seed, bf16=args.bf16, use_cpu=device.type == "cpu",
        report_to=args.report_to or "none", remove_unused_columns=False,
        disable_tqdm=False, log_level="error", save_only_model=False,
        ddp_find_unused_parameters=find_unused if world > 1 else None,
        ddp_bucket_cap_mb=args.ddp_bucket_mb if world > 1 else None)


def training_arguments(args, output_dir, total_steps, lr_warm, find_unused, world, device):
    """The run's `TrainingArguments`: cat-fast's fields (`own_fields`) and the accepted ``--trainer-args``."""
    own = own_fields(args, output_dir, total_steps, lr_warm, find_unused, world, device)
    given = dict(getattr(args, "trainer_args", None) or {})
    clash = sorted(set(own) & set(given))
    if clash:  # `resolve` refuses them; a field cat-fast sets is never overridden silently
        raise CliError(f"--trainer-args --{clash[0]}: cat-fast sets it itself")
    return _construct({**own, **given}, list(given), given)


def loader_kwargs(given: Optional[Dict]) -> Dict:
    """The training DataLoader's options from the ``--trainer-args`` dataloader fields (given ones only: without
    them the loader runs in the main process, unpinned, except that the trainer pins the batches its captured steps
    take on the host); workers are forked where the platform can."""
    given = given or {}
    names = {"dataloader_num_workers": "num_workers", "dataloader_pin_memory": "pin_memory",
             "dataloader_persistent_workers": "persistent_workers", "dataloader_prefetch_factor": "prefetch_factor",
             "dataloader_in_order": "in_order"}
    kwargs = {"num_workers": 0, **{names[k]: v for k, v in given.items() if k in names}}
    if kwargs["num_workers"] and "fork" in multiprocessing.get_all_start_methods():
        kwargs["multiprocessing_context"] = "fork"
    return kwargs
