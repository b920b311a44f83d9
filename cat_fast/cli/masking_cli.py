"""``cat-fast mask`` and ``cat-fast unlearn``: a model directory with the top neurons of a mediation analysis masked,
or unlearned (`cat_fast.analysis.masking`, `cat_fast.analysis.unlearning`, docs/METHODS.md §3).

    cat-fast mask --model runs/erm --nie runs/erm-nie --top-k 175 --out runs/erm-masked
    cat-fast mask --model runs/erm --nie runs/erm-nie --select-k --select-dev dev.tsv --out runs/erm-masked
    cat-fast unlearn --model runs/erm --nie runs/erm-nie --task nli --bias runs/overlap-bias --out runs/erm-unlearned

``mask --select-k`` chooses k on data (`cat_fast.cli.k_select`): the model masked with each k of ``--k-grid`` is
scored on ``--select-dev`` and/or the set of ``--k-rule best-on:FILE``; ``k_selection.json`` in the output holds the
curve, the rule and the chosen k. ``unlearn`` has no ``--select-k`` (each k would be a training run): choose k with
``mask --select-k`` and pass it as ``--top-k``.

``nie.pt`` records the analysed model's shape, weights fingerprint and mask (`cat_fast.analysis.nie_file`); ``mask``
and ``unlearn`` refuse it for any other model. ``mask`` refuses a masked model (masking replaces a mask).
"""
from __future__ import annotations

import math
import os
import sys
from typing import Dict, Optional

from .common import (
    CHECKPOINT_META,
    AtomicDir,
    CliError,
    TrainingFailed,
    get_device,
    setup_device,
    write_json,
)
from .evaluate import checkpoint_meta
from .scoring import encode_batches
from .sources import Source

__all__ = ["mask", "unlearn"]


def mask(args) -> Dict:
    from ..analysis import masking
    from ..models.pretrained import load_classifier, resolve_model_dir
    from .k_select import check_select_options, select_k

    if not (math.isfinite(args.factor) and 0 <= args.factor <= 1):
        raise CliError(f"--factor must be a finite number in [0, 1] (0: the hard mask; between: the activation "
                       f"weakened), got {args.factor}")
    scored = check_select_options(args)
    directory = resolve_model_dir(args.model)
    AtomicDir.check(args.out, args.overwrite, inputs=[directory, args.nie] + scored)
    model, tokenizer = load_classifier(directory, None, saved_mask="refuse")  # masking replaces a mask: refused
    effects, saved, path = _read_nie(args.nie, model)
    selection: Optional[Dict] = None
    if args.select_k:
        selection = select_k(args, model, tokenizer, effects, directory)
        k = selection["chosen_k"]
    else:
        k = args.top_k or int(saved.get("top_k", 1))
    chosen = _neurons(effects, k, args, path)
    if k > 0:
        try:
            masking.mask_neurons(model, chosen, args.factor, rescale=args.rescale)
        except ValueError as error:
            raise CliError(f"--nie {path} does not fit {args.model}: {error}") from error
    meta = {"model": args.model, "nie": path, "top_k": k, "neurons": "random" if args.random_neurons else "top",
            "seed": args.seed, "factor": args.factor, "rescale": args.rescale, "select_k": bool(args.select_k)}
    extra = {"k_selection.json": selection} if selection is not None else {}
    _write_model_dir(args, model, tokenizer, directory, "mask.json", meta, extra)
    which = f"{k} random" if args.random_neurons else f"top {k}"
    sys.stderr.write(f"cat-fast: wrote {args.out} ({which} neurons masked by {args.factor}; load it with "
                     "cat_fast.analysis.masking.load_masked)\n")
    return meta


def unlearn(args) -> Dict:
    """``cat-fast unlearn``: gradient unlearning of the top neurons of ``--nie`` on the training data's advantaged
    examples (the ``--bias`` model right, the model wrong; ``--examples random``: as many random examples, the
    paper's control); writes a model directory."""

    import torch

    from ..analysis import unlearning
    from ..bias import load_bias
    from ..models.pretrained import load_classifier, resolve_model_dir
    from .bias import resolve
    from .train import check_max_length

    directory = resolve_model_dir(args.model)
    AtomicDir.check(args.out, args.overwrite, inputs=[directory, args.nie, args.bias] + list(args.train or []))
    source = Source.from_args(args, checkpoint_meta(directory))
    train = source.read_train(args.train)
    model, tokenizer = load_classifier(directory, None)  # a masked model unlearns masked; its output keeps the mask
    check_max_length(args.max_length, model, pairs=train.text_pair is not None)
    effects, saved, path = _read_nie(args.nie, model)  # before any step: the fingerprint is of the analysed weights
    k = args.top_k or int(saved.get("top_k", 1))
    chosen = _neurons(effects, k, args, path)
    labels = tuple(model.config.id2label[i] for i in range(model.config.num_labels))
    try:
        bias = load_bias(resolve(args.bias), data=train, label_names=list(labels), extra="ignore")
    except (ValueError, OSError) as error:
        raise CliError(f"--bias {args.bias}: {error}") from error
    device = get_device(args.device)
    setup_device(device)
    model.to(device)
    g = torch.Generator().manual_seed(args.seed)

    def batches_of(rows):
        out = encode_batches(tokenizer, train, rows, args.batch_size, args.max_length, device)
        for start, batch in zip(range(0, len(rows), args.batch_size), out):
            batch["bias"] = bias[list(rows[start:start + args.batch_size])].to(device)
        return out

    # the advantaged set, chosen once with the model in eval mode (unlearning.advantaged_rows)
    candidate = _candidate(args.candidate_class, labels)
    masks = unlearning.advantaged_rows(model, batches_of(list(range(len(train)))), candidate)
    advantaged = torch.nonzero(torch.cat([m.cpu() for m in masks])).flatten()
    n_adv = int(advantaged.numel())
    if n_adv == 0 and args.examples != "all":
        raise CliError("no advantaged examples (the bias model right and the model wrong"
                       + (f", gold label {args.candidate_class}" if candidate is not None else "")
                       + ") in the training data: nothing to unlearn; nothing written")
    if args.examples == "advantaged":
        rows = advantaged
    elif args.examples == "random":  # the paper's control: as many examples, drawn at random
        rows = torch.randperm(len(train), generator=g)[:n_adv]
    else:
        rows = torch.arange(len(train))
    rows = rows[torch.randperm(rows.numel(), generator=g)].tolist()
    try:
        stats = unlearning.unlearn(model, chosen, batches_of(rows), lr=args.lr, epochs=args.epochs,
                                   weight_decay=args.weight_decay, advantaged=False, progress=True)
    except ValueError as error:
        raise CliError(str(error)) from error
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise TrainingFailed("unlearning made a parameter non-finite (lower --lr); nothing written")
    meta = {"model": args.model, "nie": path, "top_k": k, "neurons": "random" if args.random_neurons else "top",
            "examples": args.examples, "candidate_class": args.candidate_class, "advantaged_examples": n_adv,
            "examples_used": len(rows), "seed": args.seed, "lr": args.lr, "epochs": args.epochs,
            "batch_size": args.batch_size, **stats}
    _write_model_dir(args, model, tokenizer, directory, "unlearn.json", meta)
    sys.stderr.write(f"cat-fast: wrote {args.out} ({stats['steps']} steps on {len(rows)} {args.examples} examples; "
                     f"{n_adv} advantaged)\n")
    return meta


def _candidate(name, labels):
    """--candidate-class as a label index (a name or an index), or None."""
    if name is None:
        return None
    if name in labels:
        return labels.index(name)
    if name.isdigit() and int(name) < len(labels):
        return int(name)
    raise CliError(f"--candidate-class: expected one of the model's labels {', '.join(labels)} (or an index), "
                   f"got {name!r}")


def _neurons(effects, k, args, path):
    """--top-k neurons of the analysis, or (--random-neurons) as many drawn uniformly with --seed."""
    n = effects.flat()[0].numel()
    if k > n:
        raise CliError(f"--top-k {k} is larger than the {n} neurons in --nie {path}")
    return effects.random(k, args.seed) if args.random_neurons else effects.top(k)


def _write_model_dir(args, model, tokenizer, source_dir, meta_name, meta, extra: Optional[Dict] = None):
    """--out: the model and tokenizer, the source checkpoint's cat-fast metadata, `meta` (and each JSON of
    `extra`: file name -> content), atomically; a masked model also its README.md, saying how to load it masked
    (`masking.write_readme`)."""
    import shutil

    from ..analysis import masking

    atomic = AtomicDir(args.out, args.overwrite)
    with atomic as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        masking.write_readme(tmp, model)
        src = os.path.join(source_dir, CHECKPOINT_META)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(tmp, CHECKPOINT_META))
        write_json(os.path.join(tmp, meta_name), meta)
        for name, content in (extra or {}).items():
            write_json(os.path.join(tmp, name), content)
        atomic.commit()


def _read_nie(nie, model):
    """(effects, record, path) of --nie, checked against `model` (`cat_fast.analysis.nie_file.load`)."""
    from ..analysis import nie_file

    try:
        effects, saved = nie_file.load(nie, model)
    except nie_file.NieFileError as error:
        raise CliError(f"--nie {error}") from error
    return effects, saved, nie_file.resolve(nie)
