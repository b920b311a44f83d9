"""``cat-fast mediation`` and ``cat-fast mask``: the NIE of every neuron of a trained classifier, and a model
directory with the top neurons masked (`cat_fast.analysis`, docs/METHODS.md §3).

    cat-fast mediation --model runs/erm --task nli --out runs/erm-nie          # NIE tables, top neurons, figure
    cat-fast mask --model runs/erm --nie runs/erm-nie --top-k 175 --out runs/erm-masked
    cat-fast unlearn --model runs/erm --nie runs/erm-nie --task nli --bias runs/overlap-bias --out runs/erm-unlearned

Samples: ``--per-class`` pairs of each class from the built-in dev set (``--task nli``) or from ``--samples FILE``
(with the column options); treatment: the samples' pool at or above the ``--treatment-quantile`` of the share of
hypothesis words found in the premise, class-balanced. ``--method first-order`` is the one-backward screen.
A ``--per-class`` larger than the samples hold of some class is refused rather than cut down: the NIE is a mean
over the samples, and a run quietly measured on fewer than asked would not compare with the runs it is set against.

Models are loaded by `cat_fast.models.pretrained.load_classifier`: a masked model (written by ``mask``) runs masked
in ``mediation`` (its masked neurons then have no effect) and in ``unlearn`` (whose output keeps the mask); ``mask``
refuses one. ``nie.pt`` records the analysed model's shape, weights fingerprint and mask (`cat_fast.analysis.nie_file`);
``mask`` and ``unlearn`` refuse it for any other model.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Dict

from .common import (
    CHECKPOINT_META,
    AtomicDir,
    CliError,
    TrainingFailed,
    encode_batches,
    get_device,
    setup_device,
    write_json,
)
from .sources import Source

__all__ = ["mediation", "mask", "unlearn", "NIE_FILE"]

NIE_FILE = "nie.pt"


def _balanced(labels, per_class, generator, pool=None):
    import torch

    labels = torch.as_tensor(labels)
    keep = torch.ones_like(labels, dtype=torch.bool) if pool is None else pool
    classes = sorted(set(labels[keep].tolist()))
    n = min(per_class, min(int(((labels == c) & keep).sum()) for c in classes)) if classes else 0
    picks = []
    for c in classes:
        idx = torch.nonzero((labels == c) & keep).flatten()
        picks.append(idx[torch.randperm(idx.numel(), generator=generator)[:n]])
    return torch.cat(picks) if picks else torch.empty(0, dtype=torch.long)


def mediation(args) -> Dict:
    import torch

    from ..analysis import mediation as M
    from ..analysis import nie_file
    from ..bias.features import FEATURE_NAMES, overlap_features
    from ..models import COMPONENTS
    from ..models.pretrained import load_classifier, resolve_model_dir
    from .train import check_max_length

    directory = resolve_model_dir(args.model)
    AtomicDir.check(args.out, args.overwrite, inputs=[directory] + ([args.samples] if args.samples else []))
    if not 0 < args.treatment_quantile < 1:
        raise CliError(f"--treatment-quantile: expected a number in (0, 1), got {args.treatment_quantile}")
    source = Source.from_args(args, _meta(directory))
    model, tokenizer = load_classifier(directory, None)  # a masked model runs masked
    check_max_length(args.max_length, model, pairs=True)
    if args.samples:
        data = source.read(args.samples, labels=source.labels)
    elif source.task:
        data = source.builtin_dev()
    else:
        raise CliError("--samples FILE (with --text-column/--text-pair-column/--label-column) or --task nli is needed")
    if data.text_pair is None:
        raise CliError("mediation needs text pairs (premise, hypothesis): the treatment set is chosen by word overlap")
    _check_per_class(args.per_class, data, args.samples or "the dev set")
    target = args.target_class
    if target.isdigit():
        target = int(target)
    g = torch.Generator().manual_seed(args.seed)
    chosen = _balanced(data.labels, args.per_class, g)
    overlap = overlap_features(data.text, data.text_pair)[:, FEATURE_NAMES.index("h_fraction_in_p")]
    high = overlap >= torch.quantile(overlap, args.treatment_quantile)
    treat = _balanced(data.labels, len(data), g, pool=high)
    if chosen.numel() == 0 or treat.numel() == 0:
        raise CliError(f"no class-balanced samples or treatment pairs in {args.samples or 'the dev set'}")

    def tok(idx):
        enc = tokenizer([data.text[i] for i in idx.tolist()], [data.text_pair[i] for i in idx.tolist()],
                        padding=True, truncation=True, max_length=args.max_length, return_tensors="pt")
        return {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}

    from ..distributed import init_from_env

    device, rank, world = init_from_env(get_device(args.device))  # under torchrun: this rank's GPU
    setup_device(device)
    model.to(device).eval()
    layers = args.layers or None
    components = args.components or None
    start = time.time()
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            zbar = M.treatment_means(model, tok(treat), components=components or COMPONENTS, layers=layers)
            swept = sum(v.numel() for v in zbar.values())
            if args.top_k is not None and args.top_k > swept:
                raise CliError(f"--top-k {args.top_k} is larger than the {swept} neurons swept")
            if args.method == "exact":
                effects = M.neuron_effects(model, tok(chosen), zbar, target_class=target, progress=True,
                                           distributed=world > 1)
            else:
                effects = M.attribution_effects(model, tok(chosen), zbar, target_class=target)
    except ValueError as error:
        raise CliError(str(error)) from error
    seconds = time.time() - start
    if rank != 0:  # under torchrun: every rank swept its share and holds all the tables; rank 0 writes them
        return {"rank": rank, "seconds": round(seconds, 3)}
    values, _ = effects.flat()
    if not torch.isfinite(values).all():
        raise TrainingFailed("the effects contain NaN or inf (a probability of the target class underflowed?); "
                             "nothing written")
    k = args.top_k or max(1, round(values.numel() * 700 / 82944))
    top = effects.top(k)
    meta = {"model": args.model, "method": args.method, "target_class": effects.target_class,
            "samples": int(chosen.numel()), "treatment": int(treat.numel()), "treatment_quantile":
            args.treatment_quantile, "neurons": int(values.numel()), "top_k": k, "bf16": args.bf16,
            "seconds": round(seconds, 3), "device": str(device), "processes": world}
    atomic = AtomicDir(args.out, args.overwrite)
    with atomic as tmp:
        nie_file.save(os.path.join(tmp, NIE_FILE), effects, model, meta)
        with open(os.path.join(tmp, "nie_summary.tsv"), "w") as f:
            f.write("layer\tcomponent\twidth\tmax\tmean\targmax\n")
            for (layer, comp), v in sorted(effects.effects.items(), key=lambda kv: (kv[0][0], kv[0][1])):
                f.write(f"{layer}\t{comp}\t{v.numel()}\t{float(v.max()):.6g}\t{float(v.mean()):.6g}\t"
                        f"{int(v.argmax())}\n")
        with open(os.path.join(tmp, "top_neurons.tsv"), "w") as f:
            f.write("rank\tlayer\tcomponent\tneuron\tnie\n")
            for rank, (layer, comp, index, value) in enumerate(top, 1):
                f.write(f"{rank}\t{layer}\t{comp}\t{index}\t{value:.6g}\n")
        _figure(os.path.join(tmp, "top_neurons.png"), effects.counts(k), model, k)
        write_json(os.path.join(tmp, "mediation.json"), meta)
        atomic.commit()
    sys.stderr.write(f"cat-fast: wrote {args.out} ({values.numel()} neurons, {seconds:.1f} s; top {k} in "
                     f"top_neurons.tsv)\n")
    return meta


def _meta(directory):
    path = os.path.join(directory, CHECKPOINT_META)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _figure(path, counts, model, k):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from .. import models

    L = models.structure(model).num_layers
    comps = models.COMPONENTS
    grid = np.zeros((len(comps), L))
    for (layer, comp), n in counts.items():
        grid[comps.index(comp), layer - 1] = n
    fig, ax = plt.subplots(figsize=(max(4, 0.6 * L + 2), 3))
    im = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_xticks(range(L), [str(i + 1) for i in range(L)])
    ax.set_yticks(range(len(comps)), comps)
    ax.set_xlabel("layer")
    ax.set_title(f"where the top {k} neurons by NIE sit")
    fig.colorbar(im, ax=ax, label="neurons")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def mask(args) -> Dict:

    from ..analysis import masking
    from ..models.pretrained import load_classifier, resolve_model_dir

    if not (math.isfinite(args.factor) and 0 <= args.factor <= 1):
        raise CliError(f"--factor must be a finite number in [0, 1] (0: the hard mask; between: the activation "
                       f"weakened), got {args.factor}")
    directory = resolve_model_dir(args.model)
    AtomicDir.check(args.out, args.overwrite, inputs=[directory, args.nie])
    model, tokenizer = load_classifier(directory, None, saved_mask="refuse")  # masking replaces a mask: refused
    effects, saved, path = _read_nie(args.nie, model)
    k = args.top_k or int(saved.get("top_k", 1))
    chosen = _neurons(effects, k, args, path)
    try:
        masking.mask_neurons(model, chosen, args.factor, rescale=args.rescale)
    except ValueError as error:
        raise CliError(f"--nie {path} does not fit {args.model}: {error}") from error
    meta = {"model": args.model, "nie": path, "top_k": k, "neurons": "random" if args.random_neurons else "top",
            "seed": args.seed, "factor": args.factor, "rescale": args.rescale}
    _write_model_dir(args, model, tokenizer, directory, "mask.json", meta)
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
    source = Source.from_args(args, _meta(directory))
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
    everything = list(range(len(train)))
    candidate = None
    if args.candidate_class is not None:
        if args.candidate_class in labels:
            candidate = labels.index(args.candidate_class)
        elif args.candidate_class.isdigit() and int(args.candidate_class) < len(labels):
            candidate = int(args.candidate_class)
        else:
            raise CliError(f"--candidate-class: expected one of the model's labels {', '.join(labels)} (or an index), "
                           f"got {args.candidate_class!r}")
    masks = unlearning.advantaged_rows(model, batches_of(everything), candidate)
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
            "examples": args.examples, "candidate_class": args.candidate_class, "advantaged_examples": n_adv, "examples_used": len(rows), "seed": args.seed,
            "lr": args.lr, "epochs": args.epochs, "batch_size": args.batch_size, **stats}
    _write_model_dir(args, model, tokenizer, directory, "unlearn.json", meta)
    sys.stderr.write(f"cat-fast: wrote {args.out} ({stats['steps']} steps on {len(rows)} {args.examples} examples; "
                     f"{n_adv} advantaged)\n")
    return meta


def _neurons(effects, k, args, path):
    """--top-k neurons of the analysis, or (--random-neurons) as many drawn uniformly with --seed."""
    n = effects.flat()[0].numel()
    if k > n:
        raise CliError(f"--top-k {k} is larger than the {n} neurons in --nie {path}")
    return effects.random(k, args.seed) if args.random_neurons else effects.top(k)


def _check_per_class(per_class, data, where):
    """--per-class must not ask for more samples of a class than `data` holds (refused, not cut down)."""
    counts = {c: data.labels.count(c) for c in sorted(set(data.labels))}
    fewest = min(counts, key=lambda c: (counts[c], c)) if counts else None
    if fewest is not None and counts[fewest] < per_class:
        raise CliError(f"--per-class {per_class}: {where} has {counts[fewest]} examples of class "
                       f"{data.label_names[fewest]} (the fewest of its classes); pass --per-class {counts[fewest]} "
                       "or less")


def _write_model_dir(args, model, tokenizer, source_dir, meta_name, meta):
    """--out: the model and tokenizer, the source checkpoint's cat-fast metadata and `meta`, atomically; a masked
    model also its README.md, saying how to load it masked (`masking.write_readme`)."""
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
        atomic.commit()


def _read_nie(nie, model):
    """(effects, record, path) of --nie, checked against `model` (`cat_fast.analysis.nie_file.load`)."""
    from ..analysis import nie_file

    try:
        effects, saved = nie_file.load(nie, model)
    except nie_file.NieFileError as error:
        raise CliError(f"--nie {error}") from error
    return effects, saved, nie_file.resolve(nie)
