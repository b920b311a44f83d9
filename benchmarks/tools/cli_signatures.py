"""How a `cat-fast train` run's captured steps would go, counted on the host without a GPU: the run's own batches (its
data, tokenizer, batch sampler and length buckets, as `--pad auto` pads them on a GPU), its objective's plan of each
step (CAT's mixing layer and partners), each step's packed row counts as `cat_fast.step.static_row_counts` gives a
CUDA batch (`layers.training.PACKED` "auto"), and the graph signature `cat_fast.step.CapturedStep` keys it by; then
the Trainer's cache policy (`max_graphs` 64, packed graphs at most half of them, `warmup_steps` eager steps before a
batch shape's first capture, then each new row count captured at once as a CUDA build's `CapturedStep` does, a
packed step replaying a captured graph of more rows within ``share_rows``) replayed over the steps: how many steps
replay a graph (and how many of those another signature's), and how many run eagerly (warm-up steps, signatures past
the limits) or capture. Prints one JSON record.

    python benchmarks/tools/cli_signatures.py --task sentiment --method cat --batch-size 32 --max-length 256 --epochs 2

The arguments are `cat-fast train`'s (the run is prepared, not trained: nothing is written); ``--warmup-steps-policy
N [N ...]`` replays the policy with N eager steps per signature instead of the Trainer's 3; ``--share-rows F [...]``
with ``CapturedStep(share_rows=F)`` instead of its default (`cat_fast.step.SHARE_ROWS`, 1/8; 0: every row count
keys its own graph); ``--buckets REAL,LENT [...]`` counts again with the real rows rounded up to 1/REAL of a
batch's rows and the lent rows to 1/LENT (`layers.packing.BUCKETS`, `LENT_BUCKETS`; default 32,16), one record
each. ``--ranks N`` counts a torchrun run of N processes: each rank's batches (the run's batch list padded to a
multiple of N, rank r taking every N-th from the r-th, as the Trainer's loader shards it), its objective built as
under DDP (the objective's distributed preset) and reseeded as the CLI reseeds each rank, and each step's signatures
agreed as `cat_fast.step_ddp.Lockstep.agree` agrees them (`step_ddp.agreed_step`: every rank's number in the key,
every rank packing the ranks' largest counts where all pack, no sharing of graphs where they do not); the policy is
replayed on each rank's keys, which every rank sees alike, and the record gives rank 0's counts with
``ranks_agree``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root


def prepared_run(argv, rank: int = 0, world: int = 1):
    """The CLI's run for `argv` (`cat-fast train`'s arguments) through its data, model, batch plan and objective,
    on the CPU with the length buckets a GPU run pads to; as rank `rank` of `world` processes would prepare it."""
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
    run.device, run.rank, run.world = torch.device("cpu"), rank, world
    seed_everything(args.seed)
    read_train(run)
    read_dev(run, [])
    T.build(run)
    if world > 1:
        seed_everything(args.seed + rank)  # as `cat-fast train` reseeds each rank before training
    return run


def replay_policy(steps, max_graphs: int, warmup: int, share_rows: float = 0.0, count_warmup: int | None = None):
    """``(replayed, eager warm-ups, captures, eager past the limits, shared)`` of `CapturedStep`'s cache policy over
    the steps' ``(signature, padded signature or None, packed row counts or None, the batch's rows)`` (the padded
    signature and the counts where the step packs its rows; a fifth, False, where the step packs but its packed
    signatures do not share a batch shape's warm-up and graphs: under DDP where not every rank packs): `warmup`
    eager steps a padded signature (its packed signatures' together), then `count_warmup` of each packed signature's
    own (default `cat_fast.step.COUNT_WARMUP`, a CUDA build's: the capture measures the dropout offsets; 1 without
    it); `shared`: the replays of another signature's graph (``share_rows``: `cat_fast.step.shared_graph`; counted
    in `replayed` too)."""
    from cat_fast.step import COUNT_WARMUP, OWN_GRAPH_AFTER, shared_graph

    count_warmup = COUNT_WARMUP if count_warmup is None else count_warmup

    entries, packed, seen = set(), set(), collections.Counter()
    families, family_steps, shares = collections.defaultdict(list), collections.Counter(), collections.Counter()
    replayed = warm = captured = past = 0
    for step in steps:
        sig, padded, rows, total = step[:4]
        sharing = step[4] if len(step) > 4 else padded is not None
        need, family = warmup, None
        if sharing and sig not in entries:
            family = padded
            got = None
            if share_rows > 0 and shares[sig] < OWN_GRAPH_AFTER:
                got = shared_graph(families[family], rows, total, share_rows)
            if got is not None:
                shares[sig] += 1
                sig, rows = got
            elif families[family] or family_steps[family] >= warmup:
                need = count_warmup
        if padded is not None and sig not in entries and len(packed) >= max_graphs // 2:
            sig, padded, need = padded, None, warmup  # packed graphs hold half of max_graphs: the padded graph
        if sig in entries:
            replayed += 1
        elif len(entries) >= max_graphs:
            past += 1
        elif seen[sig] < need:
            seen[sig] += 1
            warm += 1
            if family is not None:
                family_steps[family] += 1
        else:
            entries.add(sig)
            captured += 1
            if padded is not None:
                packed.add(sig)
                families[family].append((sig, rows))
    return replayed, warm, captured, past, sum(shares.values())


def count(argv, warmups=(3,), max_graphs: int = 64, buckets=None, shares=None, ranks: int = 1) -> dict:
    """`main`'s record for `cat-fast train` arguments `argv`: the policy replayed with each of `warmups` eager steps
    per signature and each of `shares` (``share_rows``; default `cat_fast.step.SHARE_ROWS`); `buckets`: ``(real-row
    buckets, lent-row buckets)`` in place of `layers.packing.BUCKETS` and `LENT_BUCKETS`; `ranks`: the processes of
    a torchrun run (module docstring)."""
    from cat_fast.layers import packing
    from cat_fast.step import SHARE_ROWS

    shares = (SHARE_ROWS,) if shares is None else shares
    saved = packing.BUCKETS, packing.LENT_BUCKETS
    if buckets is not None:
        packing.BUCKETS, packing.LENT_BUCKETS = buckets
    try:
        out = _count(argv, warmups, max_graphs, shares, ranks)
    finally:
        packing.BUCKETS, packing.LENT_BUCKETS = saved
    out["buckets"] = list(buckets or saved)
    return out


def _rank_steps(argv, max_graphs, rank, world):
    """Rank `rank`'s steps: ``(signature, padded signature, packed row counts or None, the batch's rows, batch
    shape)`` each."""
    import torch

    from cat_fast.step import CapturedStep

    run = prepared_run(argv, rank, world)
    objective = run.objective
    optimizer = torch.optim.AdamW(run.model.parameters(), lr=1e-5)
    captured = CapturedStep(objective, optimizer, max_graphs=max_graphs)
    items, stream, collate = run.parts
    steps = []
    for keys in list(stream)[rank::world]:
        batch = collate([items[k] for k in keys])
        objective.step = len(steps)
        call, args = objective.call_arguments(batch)
        sig, padded, rows = captured.signature_of(call, *args, cuda_counts=True)  # as "auto" counts a CUDA batch
        mask = call["attention_mask"]
        steps.append((sig, sig if padded is None else padded, rows, mask.numel(), tuple(mask.shape)))
    return steps


def _agreed(ranks_steps):
    """Each rank's replay-policy steps (`replay_policy`) from every rank's steps (`_rank_steps` without their
    signature), agreed step by step as `Lockstep.agree` agrees them."""
    from cat_fast.step import with_rows
    from cat_fast.step_ddp import agreed_step, step_record

    ids = [{} for _ in ranks_steps]
    out = [[] for _ in ranks_steps]
    for at in zip(*ranks_steps):
        records = [step_record(ids[r].setdefault(padded, len(ids[r])), rows, total if rows is not None else 0)
                   for r, (padded, rows, total, _) in enumerate(at)]
        for r, (padded, rows, total, _) in enumerate(at):
            key, rows_run, key_rows, total_run = agreed_step(padded, rows, records)
            if key_rows is None:
                out[r].append((key, None, None, total))
            else:
                shares = key_rows == rows_run
                out[r].append((with_rows(key, key_rows), key, rows_run, total_run, shares))
    return out


def _count(argv, warmups, max_graphs, shares, ranks=1):
    ranks_steps = [_rank_steps(argv, max_graphs, r, ranks) for r in range(ranks)]
    if ranks == 1:
        policy_steps = [[(sig, None if rows is None else padded, rows, total)
                         for sig, padded, rows, total, _ in ranks_steps[0]]]
    else:
        policy_steps = _agreed([[step[1:] for step in steps] for steps in ranks_steps])
    steps = policy_steps[0]
    shapes = collections.Counter((shape, rows is not None) for _, _, rows, _, shape in ranks_steps[0])
    out = {"argv": " ".join(argv), "ranks": ranks, "steps": len(steps), "signatures": len({s[0] for s in steps}),
           "packed_steps": sum(s[1] is not None for s in steps),
           "batch_shapes": len(shapes), "max_graphs": max_graphs, "policies": []}
    agree = True
    for share in shares:
        for w in warmups:
            counted = [replay_policy(each, max_graphs, w, share) for each in policy_steps]
            agree = agree and all(c == counted[0] for c in counted)
            replayed, warm, cap, past, shared = counted[0]
            out["policies"].append({"warmup_steps": w, "share_rows": share, "replayed": replayed, "shared": shared,
                                    "eager_warmup": warm, "captures": cap, "eager_past_limits": past})
    if ranks > 1:
        out["ranks_agree"] = agree
    return out


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--warmup-steps-policy", type=int, nargs="+", default=[3])
    parser.add_argument("--buckets", type=_pair, nargs="+", default=[None], metavar="REAL,LENT")
    parser.add_argument("--share-rows", type=float, nargs="+", default=None, metavar="F")
    parser.add_argument("--ranks", type=int, default=1, metavar="N")
    own, rest = parser.parse_known_args(argv)
    if any(w < 1 for w in own.warmup_steps_policy):
        parser.error("--warmup-steps-policy: expected integers >= 1")
    if own.share_rows is not None and any(not 0 <= f <= 1 for f in own.share_rows):
        parser.error("--share-rows: expected fractions in [0, 1]")
    if own.ranks < 1:
        parser.error("--ranks: expected an integer >= 1")
    from cat_fast.cli.common import CliError, fail
    from cat_fast.data import DataError
    from cat_fast.models.pretrained import ModelLoadError

    try:
        for buckets in own.buckets:
            print(json.dumps(count(rest, tuple(own.warmup_steps_policy), buckets=buckets,
                                   shares=None if own.share_rows is None else tuple(own.share_rows),
                                   ranks=own.ranks)), flush=True)
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
