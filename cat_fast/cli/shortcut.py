"""``cat-fast shortcut plant``: a labelled dataset with a planted shortcut, the benchmark whose answer is known.

    cat-fast shortcut plant --task sentiment --train cad:sentiment/train --cue token:zeugma --strength 0.9 --out DIR

The input is read as ``cat-fast train --train`` reads it (``--task`` presets, or the column options and the columns
found by name). The cue, its strength and the splits are defined in `cat_fast.shortcuts.plant`. Writes, atomically:
``train.jsonl`` and ``dev.jsonl`` (cue correlated with ``--cue-class``), ``train_clean.jsonl`` (the training rows
without the cue: the ceiling), ``test_anti.jsonl`` (the cue on exactly the rows not of the cue class) and
``test_clean.jsonl`` (no cue), each row ``id``, ``text`` [``text_pair``], ``label`` (the name), ``cue`` (0/1) [and
``group``, the counterfactual group, when the training input has groups]; and ``shortcut.json``: the cue, strength,
seed, source, labels, whether rows have ``text_pair`` (``pairs``) and ``group`` (``groups``), and the per-split
cue-label counts. Train on them with ``--text-column text --label-column label --id-column id``
[``--text-pair-column text_pair``] [``--group-column group``] ``--labels`` (the labels of shortcut.json, in order).

A cue token already in more than 1% of the input rows is refused (the cue would be noisy); in fewer, a warning.
A cue at the end of the text (punctuation, length, ``token:WORD@end``) is planted where the model will see it: with
``--fit-max-length`` (the default), every input row's ``--cue-field`` is first cut at a word boundary so that the
row, as ``--model``'s tokenizer reads it (the pair together, special tokens included), fits in ``--max-length``
tokens with the cue's longest ending (`cat_fast.shortcuts.fit`); the inputs of every split are cut alike before the
splits are drawn, so ``train_clean`` and the test sets hold the texts the cued rows hold. shortcut.json counts the cut
rows per input (``fit_max_length``); a row that does not fit even with one word of it keeps that word, and is said. Either way, an
end-of-text cue that still lies beyond ``--max-length`` on more than 5% of the training rows with it is said
(truncation would cut it from them: ``--no-fit-max-length`` plants into the whole texts), and counted
(``beyond_max_length``). A cue at the start of the text is neither cut for nor counted.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Dict

from .common import AtomicDir, CliError, write_json
from .sources import Source

__all__ = ["plant", "SHORTCUT_FILE"]

SHORTCUT_FILE = "shortcut.json"
# The share of the training rows with an end-of-text cue that may lie beyond --max-length before it is said.
CUT_SHARE = 0.05


def _tokenizer(args):
    from ..models.pretrained import ModelLoadError, load_tokenizer
    try:
        return load_tokenizer(args.model)
    except ModelLoadError as error:
        raise CliError(f"--model {args.model}: no tokenizer to count the cue's position with ({error})") from None


def _fit_max_length(args, inputs: Dict, tokenizer) -> Dict:
    """Each input (CadData) with its cue field cut to fit ``--max-length`` with the cue (`cat_fast.shortcuts.fit`):
    the inputs replaced in `inputs`, and the record of shortcut.json's ``fit_max_length``."""
    from ..shortcuts import fit_data

    counts = {}
    for name, data in inputs.items():
        if data is not None:
            inputs[name], counts[name] = fit_data(data, args.cue, tokenizer, args.max_length, field=args.cue_field)
    return {"max_length": args.max_length, "model": args.model, "field": args.cue_field, "inputs": counts,
            "rows_cut": sum(c["rows_cut"] for c in counts.values()), "unfit": sum(c["unfit"] for c in counts.values())}


def _beyond_max_length(args, rows, tokenizer) -> Dict:
    """For a cue at the end of the text: how many training rows with the cue are longer than ``--max-length`` tokens
    of `tokenizer` (the pair counted as the model reads it), so that truncation cuts the cue from them; said when
    more than `CUT_SHARE` of them."""
    cue = args.cue
    cued = [r for r in rows if r["cue"] == 1]
    pairs = [r.get("text_pair") for r in cued] if cued and "text_pair" in cued[0] else None
    lengths = tokenizer([r["text"] for r in cued], pairs, verbose=False)["input_ids"] if cued else []
    cut = sum(len(ids) > args.max_length for ids in lengths)
    if cued and cut > CUT_SHARE * len(cued):
        sys.stderr.write(f"cat-fast: warning: --cue {cue.spec} sits at the end of the text, and {cut} of the "
                         f"{len(cued)} training rows with it are longer than --max-length {args.max_length} tokens "
                         f"({args.model}'s tokenizer): trained at that length, they lose the cue. Train with a larger "
                         f"--max-length, {'' if args.fit_max_length else 'plant with --fit-max-length, '}or plant a "
                         "cue at the start (token:WORD@start, casing)\n")
    return {"max_length": args.max_length, "model": args.model, "rows_with_cue": len(cued), "longer": cut}


def plant(args) -> Dict:
    from ..shortcuts import ShortcutError
    from ..shortcuts import plant as plant_cue

    source = Source.from_args(args)
    AtomicDir.check(args.out, args.overwrite, inputs=list(args.train or []) + [args.dev or "", args.test or ""])
    train = source.read_train(args.train)
    labels = list(source.label_names(train))
    dev = source.read(args.dev, labels) if args.dev else None
    test = source.read(args.test, labels) if args.test else None
    cue_class = labels[0] if args.cue_class is None else args.cue_class
    if cue_class not in labels:
        raise CliError(f"--cue-class {cue_class!r} is not a label of the data (labels: {', '.join(labels)})")
    if args.cue_field == "text_pair" and train.text_pair is None:
        raise CliError("--cue-field text_pair needs text pairs (--text-pair-column, or a pair of columns found by "
                       "name); these data have single texts")
    tokenizer = _tokenizer(args) if args.cue.at_end else None
    inputs = {"train": train, "dev": dev, "test": test}
    fit = _fit_max_length(args, inputs, tokenizer) if tokenizer is not None and args.fit_max_length else None
    try:
        result = plant_cue(inputs["train"], args.cue, args.strength, labels.index(cue_class), args.seed,
                           field=args.cue_field, dev=inputs["dev"], test=inputs["test"],
                           dev_fraction=args.dev_fraction, test_fraction=args.test_fraction)
    except ShortcutError as error:
        flags = {"train": "--train", "dev": "--dev" if args.dev else "--dev-fraction",
                 "test": "--test" if args.test else "--test-fraction"}
        raise CliError(f"{flags.get(error.split, '--cue')}: {error}") from None
    for warning in result.warnings:
        sys.stderr.write(f"cat-fast: warning: --cue: {warning}\n")
    if fit and fit["unfit"]:
        sys.stderr.write(f"cat-fast: warning: --fit-max-length: {fit['unfit']} input rows do not fit in --max-length "
                         f"{args.max_length} tokens with the cue even cut to one word of --cue-field {args.cue_field} "
                         "(the rest of the row is longer); they keep that word\n")
    beyond = _beyond_max_length(args, result.splits["train"], tokenizer) if tokenizer is not None else None
    record = {"cue": args.cue.spec, "kind": args.cue.kind, "field": args.cue_field, "strength": args.strength,
              "cue_class": cue_class, "labels": labels, "seed": args.seed,
              "source": {"task": source.name, "train": args.train, "dev": args.dev, "test": args.test,
                         "columns": dict(source.columns), "dev_fraction": None if args.dev else args.dev_fraction,
                         "test_fraction": None if args.test else args.test_fraction},
              "pairs": train.text_pair is not None, "groups": "group" in result.splits["train"][0],
              "splits": result.statistics, "fit_max_length": fit, "beyond_max_length": beyond}
    atomic = AtomicDir(args.out, args.overwrite)
    with atomic as tmp:
        for name, rows in result.splits.items():
            with open(os.path.join(tmp, f"{name}.jsonl"), "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        write_json(os.path.join(tmp, SHORTCUT_FILE), record)
        atomic.commit()
    sizes = ", ".join(f"{name} {len(rows)}" for name, rows in result.splits.items())
    cut = f"; {fit['rows_cut']} input rows cut to fit --max-length {args.max_length}" if fit else ""
    sys.stderr.write(f"cat-fast: wrote {args.out} ({record['cue']} for {cue_class!r} at strength {args.strength}; "
                     f"{sizes}{cut})\n")
    return record
