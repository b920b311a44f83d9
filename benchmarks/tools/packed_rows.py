"""The training layer's packed path (`cat_fast.layers.training.PACKED`) in steps of the suite, off and on
alternated, at each size (the step suite's model and batches, bf16), with the ``reduce-overhead``-compiled plain step
of the same process as the peer. GPU only. ``plain_training_layers`` is the eager plain step with the training
layers; the captured methods (``plain_fast_captured``, ``poe_captured``, ``learned_mixin_captured``,
``cat_captured``, ``gs_first_order_captured`` (central), ``gs_first_order_fwd_captured``, ``gs_pooled_captured``)
pack, per graph, the batch's real rows rounded up to a 32nd of its rows (`layers.packing.bucket`), where the
objective declares `packs_rows`. Off and on are two steps built apart (each its own model and graphs), timed in turn
with the packed switch set for each.

    python benchmarks/tools/packed_rows.py 8x128 32x128 64x256 --method plain_fast_captured poe_captured \
        [--rounds 2] [--steps 20] [--no-peer] [--cat-layers 8 9 10]

``--cat-layers`` times CAT's steps with the mixing layer fixed, one pair of steps per layer (a row each), so that
packed and padded are compared at the same layer rather than over drawn ones, whose mix moves a median by more than
the difference between the arms.

Prints one JSON line per size and method: the median step in ms of each round, PACKED off and on, the peer's, the
ratios of the medians over the rounds to the peer's, and for the captured methods each arm's graphs, packed graphs
and replayed steps (a step that replayed no graph ran eagerly).
"""
import argparse
import contextlib
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
from benchmarks.steps import harness as S  # noqa: E402
from benchmarks.steps.timing import time_steps  # noqa: E402
from cat_fast.layers import training as training_layer  # noqa: E402

CHOICES = ("plain_training_layers", "plain_fast_captured", "poe_captured", "learned_mixin_captured", "cat_captured",
           "gs_first_order_captured", "gs_first_order_fwd_captured", "gs_pooled_captured")


@contextlib.contextmanager
def _packed(value):
    saved, training_layer.PACKED = training_layer.PACKED, value
    try:
        yield
    finally:
        training_layer.PACKED = saved


def _time(step, steps, packed):
    with _packed(packed), torch.autocast("cuda", torch.bfloat16):
        return round(time_steps(step, 5, steps)[0], 3)


def _build(method, size, packed, layers=None):
    with _packed(packed):  # a captured step primed at build time captures with the switch as set
        return S.build_step(method, size, layers)[2]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("sizes", nargs="+", metavar="BxT")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--method", nargs="+", default=["plain_training_layers"], choices=CHOICES)
    p.add_argument("--no-peer", action="store_true", help="skip the compiled plain step")
    p.add_argument("--cat-layers", type=int, nargs="+", default=None,
                   help="CAT's mixing layer fixed, one pair of steps per layer given (CAT methods only)")
    args = p.parse_args()
    if args.cat_layers and not any(m.startswith("cat") for m in args.method):
        p.error("--cat-layers: expected a CAT method among --method (cat_captured)")
    if not torch.cuda.is_available():
        sys.exit("packed_rows.py: needs a CUDA GPU")
    for size in args.sizes:
        peer = None if args.no_peer else S.build_step("plain_compiled_ro", size)[2]
        arms = [(m, layer) for m in args.method  # (method, CAT's fixed layer or None: the suite's drawn ones)
                for layer in (args.cat_layers if args.cat_layers and m.startswith("cat") else [None])]
        steps = {a: {packed: _build(a[0], size, packed, None if a[1] is None else [a[1]]) for packed in (False, True)}
                 for a in arms}
        medians = {a: {"off": [], "on": []} for a in arms}
        peer_ms = []
        for _ in range(args.rounds):
            if peer is not None:
                peer_ms.append(_time(peer, args.steps, False))
            for a in arms:
                for packed in (False, True):
                    medians[a]["on" if packed else "off"].append(_time(steps[a][packed], args.steps, packed))
        for a in arms:
            row = {"size": size, "method": a[0], "median_ms": medians[a]}
            if a[1] is not None:
                row["cat_layer"] = a[1]
            for packed, name in ((False, "off"), (True, "on")):  # what each arm's steps ran: graphs, or eagerly
                captured = getattr(steps[a][packed], "captured", None)
                if captured is not None:
                    row.setdefault("graphs", {})[name] = {"graphs": captured.num_graphs,
                                                          "packed_graphs": captured.num_packed_graphs,
                                                          "replays": captured.num_replays}
            if peer_ms:
                ref = statistics.median(peer_ms)
                row["peer_ms"] = peer_ms
                row["x_peer"] = {k: round(statistics.median(v) / ref, 3) for k, v in medians[a].items()}
            print(json.dumps(row), flush=True)
        del steps, peer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
