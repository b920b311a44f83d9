"""``cat-fast mediation``'s treatment options read into `cat_fast.analysis.treatment.select_treatment`.

``--treatment FILE`` (example ids, one per line, or a column ``id`` of a CSV/TSV/JSON Lines file),
``--treatment-where COLUMN=VALUE`` (a column of the ``--samples`` file itself, compared as text),
``--treatment-from-bias DIR`` (a ``cat-fast bias fit`` output for the samples: the rows whose bias probability of
its predicted class is at least ``--bias-confidence``), else for text pairs the word-overlap rule
(``--treatment-quantile``).
"""
from __future__ import annotations

import math
import os
from typing import Dict, List, Tuple

from .common import CliError

__all__ = ["check_treatment_options", "treatment_rows"]

_OPTIONS = "--treatment FILE, --treatment-where COLUMN=VALUE or --treatment-from-bias DIR"


def check_treatment_options(args) -> None:
    """The treatment options' shapes, before anything is loaded."""
    given = [flag for flag, v in (("--treatment", args.treatment), ("--treatment-where", args.treatment_where),
                                  ("--treatment-from-bias", args.treatment_from_bias)) if v]
    if len(given) > 1:
        raise CliError(f"{' and '.join(given)}: expected one treatment rule ({_OPTIONS})")
    if not 0 < args.treatment_quantile < 1:
        raise CliError(f"--treatment-quantile: expected a number in (0, 1), got {args.treatment_quantile}")
    if not (math.isfinite(args.bias_confidence) and 0 < args.bias_confidence <= 1):
        raise CliError(f"--bias-confidence: expected a probability in (0, 1], got {args.bias_confidence}")
    if args.treatment_where and "=" not in args.treatment_where:
        raise CliError(f"--treatment-where {args.treatment_where}: expected COLUMN=VALUE (a column of --samples)")
    if args.treatment_where and not args.treatment_where.partition("=")[0].strip():
        raise CliError(f"--treatment-where {args.treatment_where}: expected COLUMN=VALUE with a column name")
    if args.treatment and not os.path.isfile(args.treatment):
        raise CliError(f"--treatment {args.treatment}: file not found; expected example ids, one per line or a "
                       "column 'id'")


def treatment_rows(args, source, data) -> Tuple[object, object, Dict]:
    """``(treatment, control, record)``: the rows of `data` the chosen rule selects, the others, and what was
    chosen (for mediation.json)."""
    from ..analysis.treatment import select_treatment

    if args.treatment:
        flag, record = f"--treatment {args.treatment}", {"rule": "ids", "file": args.treatment}
        kwargs = {"ids": _read_ids(args.treatment)}
    elif args.treatment_where:
        column, _, value = args.treatment_where.partition("=")
        column, value = column.strip(), value.strip()
        flag, record = f"--treatment-where {args.treatment_where}", {"rule": "where", "column": column,
                                                                     "value": value}
        kwargs = {"where": (_column_values(args, source, data, column), value)}
    elif args.treatment_from_bias:
        flag = f"--treatment-from-bias {args.treatment_from_bias}"
        record = {"rule": "bias", "bias": args.treatment_from_bias, "confidence": args.bias_confidence}
        kwargs = {"bias": _bias(args.treatment_from_bias, data, flag), "confidence": args.bias_confidence}
    elif data.text_pair is not None:
        flag, record = "--treatment-quantile", {"rule": "overlap", "quantile": args.treatment_quantile}
        kwargs = {"overlap_quantile": args.treatment_quantile}
    else:
        raise CliError(f"the samples are single texts: choose their treatment set with {_OPTIONS} (the default, "
                       "high word overlap, needs text pairs)")
    try:
        treat, control = select_treatment(data, **kwargs)
    except ValueError as error:
        raise CliError(f"{flag}: {error}") from None
    return treat, control, record


def _read_ids(path: str) -> List[str]:
    """Example ids: one per line (a first line ``id`` is a header), or the column ``id`` of a table."""
    from ..data import DataError
    from ..data.readers import read_rows

    with open(path, encoding="utf-8-sig") as f:
        lines = [line.strip() for line in f if line.strip()]
    ext = os.path.splitext(path)[1].lower()
    if ext in (".json", ".jsonl", ".csv") or (lines and "\t" in lines[0]):
        try:
            table = read_rows(path, ["id"], None)
        except DataError as error:
            raise CliError(f"--treatment {path}: {error}; expected ids one per line or a column 'id'") from None
        ids = [_as_id(v) for v in table.cols["id"]]
        return [i for i in ids if i]
    return lines[1:] if lines and lines[0] == "id" else lines


def _as_id(v) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return "" if v is None else str(v).strip()


def _column_values(args, source, data, column: str) -> List[str]:
    """The value of `column` in each row of `data`, read from the same --samples file (same rows and ids)."""
    from ..data import DataError, load_table
    from .sources import BUILTIN_PREFIX, split_of

    flag = f"--treatment-where {args.treatment_where}"
    if not args.samples or args.samples.startswith(BUILTIN_PREFIX) or not source.custom:
        raise CliError(f"{flag}: filters on a column of your own --samples FILE (with the column options); the "
                       f"built-in samples have none (use --treatment FILE with their ids)")
    path, split = split_of(args.samples)
    cols = data.spec.text_columns
    try:
        table = load_table(path, text_column=cols[0], text_pair_column=cols[1] if len(cols) > 1 else None,
                           label_column=column, id_column=source.columns.get("id_column"), split=split,
                           default_split="validation")
    except DataError as error:
        raise CliError(f"{flag}: {str(error).replace('empty label in', 'empty value in')}") from None
    if list(table.ids) != list(data.ids):
        raise CliError(f"{flag}: the rows read with column {column!r} are not the samples' rows")
    return [table.label_names[y] for y in table.labels]


def _bias(directory: str, data, flag: str):
    from ..bias import load_bias
    from .bias import resolve

    try:
        return load_bias(resolve(directory), data=data, label_names=list(data.label_names), extra="ignore")
    except (ValueError, OSError) as error:
        raise CliError(f"{flag}: {error}") from None
