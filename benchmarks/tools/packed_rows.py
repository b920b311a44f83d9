"""The training layer's packed path (`cat_fast.layers.training.PACKED`) in a step of the suite, off and on
alternated, at each size (the step suite's model and batches, bf16). GPU only. The default step is the eager plain
step with the training layers; ``--method plain_fast_captured`` times `CapturedStep(ERM(fast=True))`, whose graph
packs the batch's real rows rounded up to eighths of its rows (`layers.packing.bucket`).

    python benchmarks/tools/packed_rows.py 32x128 64x256 [--method plain_fast_captured] [--rounds 2] [--steps 20]

Prints one JSON line per size: the median step in ms of each round, PACKED off and on.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
from benchmarks.steps import harness as S  # noqa: E402
from benchmarks.steps.timing import time_steps  # noqa: E402
from cat_fast.layers import training as training_layer  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("sizes", nargs="+", metavar="BxT")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--method", default="plain_training_layers", choices=("plain_training_layers", "plain_fast_captured"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("packed_rows.py: needs a CUDA GPU")
    for size in args.sizes:
        _, _, step = S.build_step(args.method, size)
        medians = {"off": [], "on": []}
        for _ in range(args.rounds):
            for packed in (False, True):
                training_layer.PACKED = packed
                with torch.autocast("cuda", torch.bfloat16):
                    median, _, _, _ = time_steps(step, 5, args.steps)
                medians["on" if packed else "off"].append(round(median, 3))
        training_layer.PACKED = False
        print(json.dumps({"size": size, "method": args.method, "median_ms": medians}), flush=True)


if __name__ == "__main__":
    main()
