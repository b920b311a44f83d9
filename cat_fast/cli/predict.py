"""``cat-fast predict``: every example's predicted label and class probabilities from a checkpoint, as CSV or JSON
Lines (the format follows the extension of ``--out``).

    cat-fast predict --model runs/demo --data reviews.jsonl --out runs/demo/predictions.csv

The data is read as ``cat-fast eval`` reads it: ``--task`` presets (CAD-format files), else the column options and
the columns found by name (``PATH@SPLIT`` for a split of a dataset folder), by default the data the checkpoint was
trained on; its labels are matched to the model's by name. A file without a label column (none given with
``--label-column``, none found by name) is predicted without gold labels. One row per example, in the data's order
(rows with empty text are skipped, as in training): ``id`` (``--id-column``, else the row number), ``prediction``
(the label name), ``prob_<label>`` for each of the model's labels (JSON Lines: a ``probs`` object) and ``gold``
when the data has labels. The file is written atomically (a temporary file beside it, renamed into place); an
existing file is replaced only with ``--overwrite``, and never the --data file itself.
"""
from __future__ import annotations

import csv
import json
import os
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

from .common import CliError, get_device, setup_device
from .evaluate import checkpoint_meta, read_labels, to_model_ids
from .scoring import predict_probs
from .sources import Source, split_of

__all__ = ["predict", "FORMATS"]

FORMATS = {".csv": "csv", ".jsonl": "jsonl"}  # --out extension -> format


def predict(args) -> Dict:
    from ..data import TokenizedData
    from ..models.pretrained import label_names_of, load_classifier, resolve_model_dir
    from .train import check_max_length

    out, fmt = _check_out(args.out, args.overwrite, args.data)
    directory = resolve_model_dir(args.model)
    meta = checkpoint_meta(directory)
    source = Source.from_args(args, meta)
    max_length = args.max_length or int(meta.get("max_length", 128))
    device = get_device(args.device)
    setup_device(device)
    model, tokenizer = load_classifier(directory, None)  # a directory written by `cat-fast mask` runs masked
    model_names = label_names_of(model.config)
    label_names = read_labels(directory, source.labels, model_names)
    data = _unlabelled(source, args.data, label_names, given=getattr(args, "label_column", None) is not None)
    gold = data is None
    if gold:
        data = to_model_ids(source.read(args.data, labels=label_names), model_names, directory)
    if data.skipped:
        sys.stderr.write(f"cat-fast: {data.skipped} row(s) with empty text skipped (first: "
                         f"{', '.join(data.skipped_where[:3])})\n")
    check_max_length(max_length, model, pairs=data.text_pair is not None, flag="--max-length" if args.max_length
                     else f"the checkpoint's max_length ({max_length})")
    model.to(device)
    probs = predict_probs(model, TokenizedData(data, tokenizer, max_length), args.eval_batch_size, device, args.bf16)
    names = tuple(data.label_names)  # the model's labels in id order (unnamed ones: the data's, as eval takes them)
    preds = probs.argmax(-1).tolist()
    rows = [{"id": data.ids[i], "prediction": names[p], "probs": dict(zip(names, map(float, probs[i].tolist()))),
             **({"gold": names[data.labels[i]]} if gold else {})} for i, p in enumerate(preds)]
    _write(out, fmt, rows, names, gold)
    summary = {"model": args.model, "data": args.data, "out": out, "n": len(rows), "labels": list(names)}
    said = f"{len(rows)} predictions"
    if gold and rows:
        summary["accuracy"] = sum(p == y for p, y in zip(preds, data.labels)) / len(rows)
        said += f", accuracy {summary['accuracy']:.4f}"
    sys.stderr.write(f"cat-fast: wrote {args.out} ({said})\n")
    return summary


def _check_out(path: str, overwrite: bool, data: str) -> Tuple[str, str]:
    """(the file to write, its format) of --out, checked before any work: a .csv or .jsonl file (a symbolic link is
    followed), replaced only with `overwrite` and never when it is the --data file."""
    fmt = FORMATS.get(os.path.splitext(path)[1].lower())
    if fmt is None:
        raise CliError(f"--out {path}: expected a file ending in {' or '.join(FORMATS)} (the format follows the "
                       "extension)")
    real = os.path.realpath(path)
    if os.path.isdir(real):
        raise CliError(f"--out {path} is a directory; expected a {' or '.join(FORMATS)} file")
    source = split_of(data)[0] if data else None
    if source and os.path.exists(source) and os.path.realpath(source) == real:
        raise CliError(f"--out {path} is the --data file; choose another --out")
    if os.path.exists(real) and not overwrite:
        raise CliError(f"--out {path} exists; pass --overwrite to replace it")
    return real, fmt


def _unlabelled(source: Source, arg: str, names: Sequence[str], given: bool):
    """The examples of `arg` (a CadData with placeholder labels) when it has no label column: none given on the
    command line, and neither the checkpoint's label column nor one found by name is there. None: it has labels, read
    it as ``cat-fast eval`` does (`Source.read`)."""
    from ..data import LABEL_NAMES, CadData, ChoiceError, TaskSpec, clean, find_columns
    from ..data.readers import read_rows

    if not source.custom or given:
        return None
    cols = source.columns
    roles: Dict[str, Optional[str]] = {}

    def needed(found: List[str], name: str) -> List[str]:
        label = cols.get("label_column")
        if (label in found) if label else any(c in found for c in LABEL_NAMES):
            return []  # labelled
        # the label is not looked for (a placeholder name): only the text columns are found
        text, pair, _ = find_columns(found, cols.get("text_column"), cols.get("text_pair_column"), "-", name)
        roles.update(text=text, pair=pair)
        return [c for c in (text, pair, cols.get("id_column")) if c]

    path, split = split_of(arg)
    try:
        table = read_rows(path, needed, split, "validation")
    except ChoiceError as error:
        raise CliError(error.advise({"split": f"{path}@SPLIT", "text_column": "--text-column NAME",
                                     "text_pair_column": "--text-pair-column NAME"})) from error
    if not roles:
        return None
    text, pair = roles["text"], roles["pair"]
    said = f"text={text}" + (f", text pair={pair}" if pair else "")
    sys.stderr.write(f"cat-fast: columns: {said} of {arg}; no label column ({', '.join(LABEL_NAMES)}): predicted "
                     "without gold labels\n")
    kept: Dict[str, list] = {"text": [], "pair": [], "ids": [], "sources": []}
    skipped = []
    for r in range(len(table.where)):
        a = clean(_str(table.cols[text][r]))
        b = clean(_str(table.cols[pair][r])) if pair else None
        if not a or (pair and not b):
            skipped.append(f"{table.name}:{table.where[r]}")
            continue
        kept["text"].append(a)
        kept["pair"].append(b)
        kept["ids"].append(_str(table.cols[cols["id_column"]][r]).strip() if cols.get("id_column") else str(r))
        kept["sources"].append(f"{table.name}:{table.where[r]}")
    n = len(kept["text"])
    if not n:
        raise CliError(f"--data {arg}: every row has empty text in {said}")
    spec = TaskSpec("custom", "", (text, pair) if pair else (text,), tuple(names))
    return CadData(spec, kept["text"], kept["pair"] if pair else None, [0] * n, [True] * n, list(range(n)),
                   kept["sources"], ids=kept["ids"], pairing="all", skipped=len(skipped), skipped_where=skipped[:10])


def _str(v) -> str:
    """A cell as text: None and NaN (an empty cell) are empty."""
    return "" if v is None or (isinstance(v, float) and v != v) else str(v)


def _write(path: str, fmt: str, rows: List[Dict], names: Sequence[str], gold: bool) -> None:
    """`rows` to `path`, through a temporary file beside it that is renamed into place."""
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    except OSError as e:
        raise CliError(f"cannot write --out {path}: {e.strerror or e}") from e
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
            if fmt == "jsonl":
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
            else:
                writer = csv.writer(f)
                writer.writerow(["id", "prediction"] + [f"prob_{n}" for n in names] + (["gold"] if gold else []))
                for row in rows:
                    writer.writerow([row["id"], row["prediction"]] + [repr(row["probs"][n]) for n in names]
                                    + ([row["gold"]] if gold else []))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600: the file gets ordinary permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
