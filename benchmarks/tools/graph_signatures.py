"""How many CUDA graphs a captured packed CAT step keys over a run, counted on the host without a GPU: for the
batches `ddp_step_bench.py` gives each rank (the step suite's `make_batch`, seed 1234 + rank), `--steps` draws of a
mixing layer and of each rank's partners, each step's row counts as `cat_fast.step.static_row_counts` computes them (the
real rows, the narrowed rows, the lent rows), and the signatures that gives on each rank alone and under DDP, where
a graph is keyed by every rank's counts. Reports how many signatures first appear after step 100 and 150 (the
benchmarks' warm-up), for each `layers.packing.LENT_BUCKETS` given. Prints one JSON record per size and value.

    python benchmarks/tools/graph_signatures.py 32x128 64x256 --lent-buckets 32 16
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
from benchmarks.tools import size_arg  # noqa: E402


def signatures(size: str, lent_buckets: int, steps: int, ranks: int, layers: int) -> dict:
    from transformers import BertConfig, BertForSequenceClassification

    from benchmarks.steps.harness import make_batch
    from cat_fast import step as step_module
    from cat_fast.layers import packing
    from cat_fast.layers import training as training_layers
    from cat_fast.objectives import CAT

    B, T = (int(v) for v in size.split("x"))
    config = BertConfig(vocab_size=64, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=16, attn_implementation="sdpa")
    cat = CAT(BertForSequenceClassification(config))
    batches = [make_batch(B, T, 30522, "cpu", seed=1234 + r)[0] for r in range(ranks)]
    saved = training_layers.PACKED, packing.LENT_BUCKETS
    training_layers.PACKED, packing.LENT_BUCKETS = True, lent_buckets  # the counts "auto" gives a CUDA batch
    try:
        partners = [torch.Generator().manual_seed(r) for r in range(ranks)]
        layer_draws = torch.Generator().manual_seed(ranks)
        first, per_rank, lent = {}, [set() for _ in range(ranks)], set()
        for step in range(steps):
            layer = int(torch.randint(layers, (1,), generator=layer_draws))
            counts = []
            for r in range(ranks):
                partner = torch.randperm(B, generator=partners[r])
                rows = step_module.static_row_counts(batches[r], cat, {"partner": partner})
                counts.append(rows)
                per_rank[r].add((layer, rows))
                if isinstance(rows, tuple) and len(rows) == 3:
                    lent.add(rows[2])
            first.setdefault((layer, tuple(counts)), step)
    finally:
        training_layers.PACKED, packing.LENT_BUCKETS = saved
    late = list(first.values())
    return {"size": size, "lent_buckets": lent_buckets, "steps": steps, "layers": layers,
            "signatures_per_rank": [len(s) for s in per_rank], "signatures_ddp": len(first),
            "new_after_100": sum(v >= 100 for v in late), "new_after_150": sum(v >= 150 for v in late),
            "lent_counts": sorted(lent)}


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="+", type=size_arg, help="BxT, e.g. 32x128")
    parser.add_argument("--lent-buckets", type=_positive, nargs="+", default=[16])
    parser.add_argument("--steps", type=_positive, default=300)
    parser.add_argument("--ranks", type=_positive, default=2)
    parser.add_argument("--layers", type=_positive, default=3, help="how many mixing layers CAT draws from")
    args = parser.parse_args(argv)
    for size in args.sizes:
        for buckets in args.lent_buckets:
            print(json.dumps(signatures(size, buckets, args.steps, args.ranks, args.layers)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
