"""``cat-fast mediation``: the NIE of every neuron of a trained classifier (`cat_fast.analysis`, docs/METHODS.md §3);
``mask`` and ``unlearn`` live in `cat_fast.cli.masking_cli`.

    cat-fast mediation --model runs/erm --task nli --out runs/erm-nie          # NIE tables, top neurons, figure
    cat-fast mediation --model runs/sst --samples dev.tsv --treatment-where cue=yes --target-class positive --out N
    cat-fast mask --model runs/erm --nie runs/erm-nie --top-k 175 --out runs/erm-masked
    cat-fast unlearn --model runs/erm --nie runs/erm-nie --task nli --bias runs/overlap-bias --out runs/erm-unlearned

Samples, single texts or pairs: the built-in dev set (``--task``), a shipped name (``--samples cad:sentiment/dev``)
or ``--samples FILE`` (with the column options). They split into the treatment set and the control set (every other
row; `cat_fast.analysis.treatment`): ``--treatment FILE`` (example ids), ``--treatment-where COLUMN=VALUE`` (a column
of the samples file), ``--treatment-from-bias DIR`` (the rows a ``cat-fast bias fit`` model, fitted on the samples,
predicts with probability >= ``--bias-confidence``, default 0.8), else for text pairs the rows at or above the
``--treatment-quantile`` of the share of hypothesis words found in the premise. The treatment is class-balanced
(its z̄ is not a class mean); the NIE is measured on ``--per-class`` rows of each class drawn from all the samples, as
the released code draws them from the whole dev set. A
``--per-class`` larger than the samples hold of some class is refused rather than cut down: the NIE is a mean
over the samples, and a run quietly measured on fewer than asked would not compare with the runs it is set against.
``--method first-order`` is the one-backward screen.

Models are loaded by `cat_fast.models.pretrained.load_classifier`: a masked model (written by ``mask``) runs masked
(its masked neurons then have no effect). ``nie.pt`` records the analysed model's shape, weights fingerprint and mask
(`cat_fast.analysis.nie_file`).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Dict

from .common import AtomicDir, CliError, TrainingFailed, get_device, setup_device, write_json
from .evaluate import checkpoint_meta
from .masking_cli import mask, unlearn
from .sources import BUILTIN_PREFIX, Source, builtin_files
from .treatment_options import check_treatment_options, treatment_rows

__all__ = ["mediation", "mask", "unlearn", "NIE_FILE"]

NIE_FILE = "nie.pt"


def mediation(args) -> Dict:
    import torch

    from ..analysis import mediation as M
    from ..analysis.treatment import class_balanced
    from ..models import COMPONENTS
    from ..models.pretrained import load_classifier, resolve_model_dir
    from .train import check_max_length

    directory = resolve_model_dir(args.model)
    AtomicDir.check(args.out, args.overwrite, inputs=[directory] + [p for p in (
        args.samples, args.treatment, args.treatment_from_bias) if p])
    check_treatment_options(args)
    model, tokenizer = load_classifier(directory, None)  # a masked model runs masked
    target = _target_class(args.target_class, model)
    source, data = _samples(args, directory)
    check_max_length(args.max_length, model, pairs=data.text_pair is not None)
    treat_rows, control, rule = treatment_rows(args, source, data)
    every = torch.arange(len(data))
    _check_per_class(args.per_class, data, every, args.samples or "the dev set")
    g = torch.Generator().manual_seed(args.seed)
    chosen = class_balanced(data.labels, every, args.per_class, g)
    treat = class_balanced(data.labels, treat_rows, None, g)

    def tok(idx):
        rows = idx.tolist()
        enc = tokenizer([data.text[i] for i in rows], [data.text_pair[i] for i in rows] if data.text_pair else None,
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
    meta = {"model": args.model, "method": args.method, "target_class": effects.target_class,
            "samples": int(chosen.numel()), "treatment": int(treat.numel()), "treatment_rule": rule,
            "treatment_rows": int(treat_rows.numel()), "control_rows": int(control.numel()),
            "treatment_quantile": args.treatment_quantile, "neurons": int(values.numel()), "top_k": k,
            "bf16": args.bf16, "seconds": round(seconds, 3), "device": str(device), "processes": world}
    _write(args.out, args.overwrite, effects, model, meta, k)
    sys.stderr.write(f"cat-fast: wrote {args.out} ({values.numel()} neurons, {seconds:.1f} s; top {k} in "
                     f"top_neurons.tsv)\n")
    return meta


def _samples(args, directory):
    """(source, data): --samples (a file, or a shipped name) or the built-in dev set of --task."""
    if args.samples and args.samples.startswith(BUILTIN_PREFIX) and not args.task:
        task, _ = builtin_files(args.samples)
        source = Source(task, {}, None)
    else:
        source = Source.from_args(args, checkpoint_meta(directory))
    if args.samples:
        return source, source.read(args.samples, labels=source.labels)
    if source.task:
        return source, source.builtin_dev()
    raise CliError("--samples FILE (with --text-column/--text-pair-column/--label-column) or --task is needed")


def _target_class(value, model):
    """--target-class as the model's label name (any case) or index; refused before any work if it is neither."""
    from ..models.pretrained import label_names_of

    names = label_names_of(model.config)
    lowered = [n.lower() for n in names]
    if value is None:
        if "entailment" in lowered:
            return lowered.index("entailment")
        raise CliError(f"--target-class: expected one of the model's labels ({', '.join(names)}): the class whose "
                       "probability is mediated (the default, entailment, is not one of them)")
    if value.isdigit() and int(value) < len(names):
        return int(value)
    if value.lower() in lowered:
        return lowered.index(value.lower())
    raise CliError(f"--target-class: target_class: {value!r} is not a label of the model; expected one of "
                   f"{', '.join(names)} or an index below {len(names)}")


def _check_per_class(per_class, data, rows, where):
    """--per-class must not ask for more samples of a class than the `rows` drawn from hold (refused, not cut
    down)."""
    labels = [data.labels[i] for i in rows.tolist()]
    counts = {c: labels.count(c) for c in sorted(set(data.labels))}
    fewest = min(counts, key=lambda c: (counts[c], c)) if counts else None
    if fewest is not None and counts[fewest] < per_class:
        raise CliError(f"--per-class {per_class}: {where} has "
                       f"{counts[fewest]} examples of class {data.label_names[fewest]} (the fewest of its classes); "
                       f"pass --per-class {counts[fewest]} or less")


def _write(out, overwrite, effects, model, meta, k):
    """--out: nie.pt, nie_summary.tsv, top_neurons.tsv, top_neurons.png and mediation.json, atomically."""
    from ..analysis import nie_file

    atomic = AtomicDir(out, overwrite)
    with atomic as tmp:
        nie_file.save(os.path.join(tmp, NIE_FILE), effects, model, meta)
        with open(os.path.join(tmp, "nie_summary.tsv"), "w") as f:
            f.write("layer\tcomponent\twidth\tmax\tmean\targmax\n")
            for (layer, comp), v in sorted(effects.effects.items(), key=lambda kv: (kv[0][0], kv[0][1])):
                f.write(f"{layer}\t{comp}\t{v.numel()}\t{float(v.max()):.6g}\t{float(v.mean()):.6g}\t"
                        f"{int(v.argmax())}\n")
        with open(os.path.join(tmp, "top_neurons.tsv"), "w") as f:
            f.write("rank\tlayer\tcomponent\tneuron\tnie\n")
            for rank, (layer, comp, index, value) in enumerate(effects.top(k), 1):
                f.write(f"{rank}\t{layer}\t{comp}\t{index}\t{value:.6g}\n")
        _figure(os.path.join(tmp, "top_neurons.png"), effects.counts(k), model, k)
        write_json(os.path.join(tmp, "mediation.json"), meta)
        atomic.commit()


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
