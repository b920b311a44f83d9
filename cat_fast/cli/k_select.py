"""``cat-fast mask --select-k``: choose how many top neurons to mask on held-out data (`cat_fast.analysis.k_selection`).

The grid (``--k-grid``: percentages of the neurons swept, ``0.5%``, or numbers; default a small geometric grid)
always includes k = 0, the unmasked model. Rules: ``--k-rule max-drop:D`` (default D = 3): the largest k whose
accuracy on ``--select-dev FILE`` (a dev set that carries the bias) stays within D points of the unmasked model's
for it and every smaller k of the grid, then the gap to the next k of the grid bisected ``--k-refine N`` times
(default 3; `cat_fast.analysis.k_selection.refine_max_drop`); ``--k-rule best-on:FILE``: the k of the best accuracy
on FILE (a small cue-balanced or anti-correlated set), the smallest on ties. ``k_selection.json``: the curve (k ->
the accuracy on each scored set), the files, the rule and the chosen k.
"""
from __future__ import annotations

import sys
from typing import Dict, List

from .common import CliError, get_device, setup_device
from .evaluate import checkpoint_meta, read_labels, to_model_ids
from .scoring import encode_batches
from .sources import Source

__all__ = ["check_select_options", "select_k"]


def check_select_options(args) -> List[str]:
    """The --select-k options' shapes, before anything is loaded; returns the files they score (inputs)."""
    from ..analysis.k_selection import parse_rule

    flags = [f for f, v in (("--k-grid", args.k_grid), ("--k-rule", args.k_rule), ("--select-dev", args.select_dev),
                            ("--k-refine", args.k_refine)) if v is not None]
    if not args.select_k:
        if flags:
            raise CliError(f"{flags[0]} needs --select-k (it chooses k on data)")
        return []
    if args.top_k is not None:
        raise CliError("--top-k and --select-k: expected one (--select-k chooses k on data)")
    if args.random_neurons:
        raise CliError("--random-neurons and --select-k: expected one (the random control is masked at a given "
                       "--top-k)")
    try:
        rule = parse_rule(args.k_rule or "max-drop:3")
    except ValueError as error:
        raise CliError(f"--k-rule: {error}") from None
    if rule.kind == "max-drop" and not args.select_dev:
        raise CliError(f"--k-rule {rule}: needs --select-dev FILE (the dev set the accuracy drop is measured on)")
    return [p for p in (args.select_dev, rule.value if rule.kind == "best-on" else None) if p]


def select_k(args, model, tokenizer, effects, directory) -> Dict:
    """Sweep the grid on `model` (masked in place, left unmasked) and return k_selection.json's record."""
    from ..analysis import k_selection as K
    from ..models.pretrained import label_names_of
    from .train import check_max_length

    swept = effects.flat()[0].numel()
    try:
        grid = K.parse_grid(args.k_grid or K.DEFAULT_GRID, swept)
    except ValueError as error:
        raise CliError(f"--k-grid: {error}") from None
    rule = K.parse_rule(args.k_rule or "max-drop:3")
    files = {"select-dev": args.select_dev} if args.select_dev else {}
    if rule.kind == "best-on":
        files["best-on"] = rule.value
    meta = checkpoint_meta(directory)
    source = Source.from_args(args, meta)
    model_names = label_names_of(model.config)
    labels = read_labels(directory, source.labels, model_names)
    max_length = args.max_length or int(meta.get("max_length", 128))
    data = {name: to_model_ids(source.read(path, labels=labels), model_names, directory)
            for name, path in files.items()}
    check_max_length(max_length, model, pairs=any(d.text_pair is not None for d in data.values()),
                     flag="--max-length" if args.max_length else f"the checkpoint's max_length ({max_length})")
    device = get_device(args.device)
    setup_device(device)
    model.to(device)
    sets = {name: encode_batches(tokenizer, d, list(range(len(d))), args.batch_size, max_length, device)
            for name, d in data.items()}
    ranked = effects.top(grid[-1])
    curve = K.k_curve(model, ranked, grid, sets, args.factor, args.rescale)
    on = "select-dev" if rule.kind == "max-drop" else "best-on"
    refine = K.REFINE_STEPS if args.k_refine is None else args.k_refine
    if refine:
        curve = K.refine_max_drop(model, ranked, curve, rule, on, sets, refine, args.factor, args.rescale)
    chosen = K.choose_k(curve, rule, on)
    model.to("cpu")
    if chosen == 0:
        sys.stderr.write(f"cat-fast: --k-rule {rule}: no k of the grid passes; k = 0 chosen (the model unmasked)\n")
    shown = ", ".join(f"k={p['k']}: " + " ".join(f"{n}={a:.4f}" for n, a in p["accuracy"].items()) for p in curve)
    sys.stderr.write(f"cat-fast: k selection ({rule}): {shown}; chosen k={chosen}\n")
    return {"rule": str(rule), "grid": grid, "refine": refine if rule.kind == "max-drop" else 0,
            "neurons_swept": swept, "sets": files,
            "sizes": {name: len(d) for name, d in data.items()}, "curve": curve, "chosen_k": chosen,
            "factor": args.factor, "rescale": args.rescale}
