"""Exact gradient supervision at the embedding output (the double backward through every layer) on the fused
twice-differentiable layers (`cat_fast.layers.double_layers`: attention, LayerNorm and GELU; GS's default on CUDA)
against the model's eager layers, side by side in one process, with the ``reduce-overhead``-compiled plain step as
the peer (the step suite's model and batches, bf16). GPU only.

    python benchmarks/tools/gs_exact.py 8x128 32x128 64x256 [--rounds 2] [--steps 10] [--untiled]

Each size runs in a process of its own. Prints one JSON line per size: the median captured step in ms per round of
`gs_exact_captured` (the model's eager layers), `gs_exact_fused_captured` and the peer, their ratios to the peer, and
the peak memory (MiB) of one eager step of `plain`, `gs_exact` and `gs_exact_fused`, with the GS steps' peaks as
multiples of the plain step's. ``--untiled``: the fused step also with its attention's backward kernels at the
64 × 64 tiles every kernel takes without `cat_fast.kernels.triton.attention.TILES`, as
``gs_exact_fused_captured@untiled``.
"""
import argparse
import gc
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
from benchmarks.steps import harness as S  # noqa: E402
from benchmarks.steps.timing import time_steps  # noqa: E402
from benchmarks.tools import each_size_apart  # noqa: E402
from cat_fast.kernels.triton import attention as kernels  # noqa: E402

TIMED = ("gs_exact_captured", "gs_exact_fused_captured")
MEMORY = ("plain", "gs_exact", "gs_exact_fused")


def _time(step, steps):
    with torch.autocast("cuda", torch.bfloat16):
        return round(time_steps(step, 3, steps)[0], 3)


def _peak_mib(method, size):
    """Peak allocated MiB of one eager step (after two warm-up steps) with only its model, optimizer and batch."""
    gc.collect()
    torch.cuda.empty_cache()
    model, optimizer, step = S.build_step(method, size)
    with torch.autocast("cuda", torch.bfloat16):
        step()
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**20
    del model, optimizer, step
    return round(peak, 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("sizes", nargs="+", metavar="BxT")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--untiled", action="store_true", help="also time the fused step without the attention's TILES")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gs_exact.py: needs a CUDA GPU")
    if each_size_apart(__file__, args.sizes, sys.argv[1:]):  # no size's graphs, pools or peaks carry into the next
        return
    for size in args.sizes:
        peaks = {m: _peak_mib(m, size) for m in MEMORY}
        peer = S.build_step("plain_compiled_ro", size)[2]
        steps = {m: S.build_step(m, size)[2] for m in TIMED}
        if args.untiled:
            tiles = dict(kernels.TILES)
            kernels.TILES.clear()
            try:
                step = S.build_step("gs_exact_fused_captured", size)[2]
                _time(step, 3)  # the warm-up and the capture: the graph keeps the launches of this setting
            finally:
                kernels.TILES.update(tiles)
            steps["gs_exact_fused_captured@untiled"] = step
        ms = {m: [] for m in (*steps, "peer")}
        for _ in range(args.rounds):
            ms["peer"].append(_time(peer, args.steps))
            for m, step in steps.items():
                ms[m].append(_time(step, args.steps))
        ref = statistics.median(ms["peer"])
        row = {"size": size, "median_ms": ms,
               "x_peer": {m: round(statistics.median(ms[m]) / ref, 3) for m in steps},
               "peak_mib": peaks,
               "x_plain_memory": {m: round(peaks[m] / peaks["plain"], 3) for m in MEMORY[1:]}}
        print(json.dumps(row), flush=True)
        del steps, peer
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
