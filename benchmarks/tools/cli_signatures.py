"""How a `cat-fast train` run's captured steps would go, counted on the host without a GPU: the run's own batches
(its data, tokenizer, batch sampler and length buckets, as `--pad auto` pads them on a GPU), its objective's plan of
each step (CAT's mixing layer and partners), each step's packed row counts as `cat_fast.step._static_rows` gives a
CUDA batch (`layers.training.PACKED` "auto"), and the graph signature `cat_fast.step.CapturedStep` keys it by; then
the Trainer's cache policy (`max_graphs` 64, packed graphs at most half of them, `warmup_steps` eager steps before a
signature's capture) replayed over the steps: how many steps replay a graph, and how many run eagerly (warm-up steps,
signatures past the limits) or capture. Prints one JSON record.

    python benchmarks/tools/cli_signatures.py --task sentiment --method cat --batch-size 32 --max-length 256 --epochs 2

The arguments are `cat-fast train`'s (the run is prepared, not trained: nothing is written); ``--warmup-steps-policy
N [N ...]`` replays the policy with N eager steps per signature instead of the Trainer's 3; ``--buckets REAL,LENT
[...]`` counts again with the real rows rounded up to 1/REAL of a batch's rows and the lent rows to 1/LENT
(`layers.packing.BUCKETS`, `LENT_BUCKETS`; default 32,16), one record each.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root


def prepared_run(argv):
    """The CLI's run for `argv` (`cat-fast train`'s arguments) through its data, model, batch plan and objective,
    on the CPU with the length buckets a GPU run pads to."""
    import torch

    from cat_fast import objectives
    from cat_fast.cli import build_parser
    from cat_fast.cli import train as T
    from cat_fast.cli.common import seed_everything
    from cat_fast.cli.sources import Source
    from cat_fast.cli.train_data import Prepared, read_dev, read_train
    from cat_fast.cli.train_objective import apply_objective_config, check_options, pop_given

    args = build_parser().parse_args(["train", *argv, "--device", "cpu", "--pad", "buckets"])
    given = pop_given(args)
    entry = objectives.get(args.method)
    apply_objective_config(args, given)
    run = Prepared(args, entry, Source.from_args(args))
    check_options(args)
    run.device, run.rank, run.world = torch.device("cpu"), 0, 1
    seed_everything(args.seed)
    read_train(run)
    read_dev(run, [])
    T.build(run)
    return run


def replay_policy(signatures, max_graphs: int, warmup: int):
    """(replayed, eager warm-ups, captures, eager past the limits) of `CapturedStep`'s cache policy over the steps'
    ``(signature, padded signature or None)`` pairs (the padded one where the step packs its rows)."""
    entries, packed, seen = set(), set(), collections.Counter()
    replayed = warm = captured = past = 0
    for sig, padded in signatures:
        if padded is not None and sig not in entries and len(packed) >= max_graphs // 2:
            sig, padded = padded, None  # packed graphs hold half of max_graphs: the padded graph of this shape
        if sig in entries:
            replayed += 1
        elif len(entries) >= max_graphs:
            past += 1
        elif seen[sig] < warmup:
            seen[sig] += 1
            warm += 1
        else:
            entries.add(sig)
            captured += 1
            if padded is not None:
                packed.add(sig)
    return replayed, warm, captured, past


def count(argv, warmups=(3,), max_graphs: int = 64, buckets=None) -> dict:
    """`main`'s record for `cat-fast train` arguments `argv`: the policy replayed with each of `warmups` eager steps
    per signature; `buckets`: ``(real-row buckets, lent-row buckets)`` in place of `layers.packing.BUCKETS` and
    `LENT_BUCKETS`."""
    from cat_fast.layers import packing

    saved = packing.BUCKETS, packing.LENT_BUCKETS
    if buckets is not None:
        packing.BUCKETS, packing.LENT_BUCKETS = buckets
    try:
        out = _count(argv, warmups, max_graphs)
    finally:
        packing.BUCKETS, packing.LENT_BUCKETS = saved
    out["buckets"] = list(buckets or saved)
    return out


def _count(argv, warmups, max_graphs):
    import torch

    from cat_fast.step import CapturedStep

    run = prepared_run(argv)
    objective = run.objective
    optimizer = torch.optim.AdamW(run.model.parameters(), lr=1e-5)
    captured = CapturedStep(objective, optimizer, max_graphs=max_graphs)
    items, stream, collate = run.parts
    signatures, shapes = [], collections.Counter()
    for keys in stream:
        batch = collate([items[k] for k in keys])
        objective.step = len(signatures)
        call, args = objective.call_arguments(batch)
        sig, padded = captured.signature_of(call, *args, cuda_counts=True)  # the counts "auto" gives a CUDA batch
        signatures.append((sig, padded))
        shapes[(tuple(call["attention_mask"].shape), padded is not None)] += 1
    out = {"argv": " ".join(argv), "steps": len(signatures), "signatures": len({s for s, _ in signatures}),
           "packed_steps": sum(p is not None for _, p in signatures),
           "batch_shapes": len(shapes), "max_graphs": max_graphs}
    for w in warmups:
        replayed, warm, cap, past = replay_policy(signatures, max_graphs, w)
        out[f"warmup_{w}"] = {"replayed": replayed, "eager_warmup": warm, "captures": cap, "eager_past_limits": past}
    return out


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--warmup-steps-policy", type=int, nargs="+", default=[3])
    parser.add_argument("--buckets", type=_pair, nargs="+", default=[None], metavar="REAL,LENT")
    own, rest = parser.parse_known_args(argv)
    if any(w < 1 for w in own.warmup_steps_policy):
        parser.error("--warmup-steps-policy: expected integers >= 1")
    from cat_fast.cli.common import CliError, fail
    from cat_fast.data import DataError
    from cat_fast.models.pretrained import ModelLoadError

    try:
        for buckets in own.buckets:
            print(json.dumps(count(rest, tuple(own.warmup_steps_policy), buckets=buckets)), flush=True)
    except (DataError, ModelLoadError, CliError) as e:  # one line, exit 2, as `cat-fast train` ends on them
        fail(e, getattr(e, "exit_code", 2))
    return 0


def _pair(text: str):
    parts = text.split(",")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected two positive integers REAL,LENT (e.g. 32,16), got {text!r}")
    return int(parts[0]), int(parts[1])


if __name__ == "__main__":
    sys.exit(main())
