"""Steps of the suite built under two or more values of one setting (or of several set together), timed in turn
in one process with the ``reduce-overhead``-compiled plain step as the peer: an entry of a `cat_fast.kernels.triton`
module's ``LAUNCH`` ("residual_layer_norm.params_prefetch"), a module-level switch of cat_fast
("layers.packing.VARLEN"), or one of the suite's own (`benchmarks.steps.harness`: "harness.HOST_BATCHES"). A
captured step's graphs hold the kernels as launched when they were captured, so each value gets its own step, built
and warmed up with the setting in force (and timed with it in force too). GPU only.

    python benchmarks/tools/launch_ab.py 32x128 64x256 --setting residual_layer_norm.params_prefetch \
        --values 0 1 [--method plain_fast_captured cat_captured] [--rounds 3] [--steps 20]
    python benchmarks/tools/launch_ab.py 32x128 64x256 --setting layers.packing.VARLEN --values false true
    python benchmarks/tools/launch_ab.py 64x256 --setting layers.packing.VARLEN_KERNEL --values str:flash str:triton
    python benchmarks/tools/launch_ab.py 32x128 --setting gelu_bias_backward.block_m,gelu_bias_backward.per_sm \
        --values 32,2 16,1
    python benchmarks/tools/launch_ab.py 64x256 --setting layers.packing.NARROW --values false true \
        --method cat_captured --cat-layers 8 9 10

``--cat-layers`` fixes CAT's mixing layer, one step per value and layer (a row per layer), so that the values are
compared at the same layer rather than over drawn ones, whose mix moves a median by more than most differences.

Prints one JSON line per size and method: the median step in ms per value and round, the peer's, and each value's
median over the rounds as × the peer's median. Each size runs in a process of its own.
"""
import argparse
import contextlib
import importlib
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
from benchmarks.steps import harness as S  # noqa: E402
from benchmarks.steps.timing import time_steps  # noqa: E402
from benchmarks.tools import each_size_apart  # noqa: E402


def _launch(setting):
    """(the dict that holds the setting, its key) for "module.key" (a `cat_fast.kernels.triton` module's LAUNCH
    entry) or "dotted.module.NAME" (a module-level setting of `cat_fast.dotted.module`); raises naming the setting
    when there is none."""
    module_name, _, key = setting.rpartition(".")
    if not module_name or not key:
        raise SystemExit(f"--setting {setting!r}: expected module.key")
    try:
        launch = importlib.import_module(f"cat_fast.kernels.triton.{module_name}").LAUNCH
    except (ImportError, AttributeError):
        launch = None
    if launch is not None:
        if key not in launch:
            raise SystemExit(f"--setting {setting!r}: LAUNCH has {sorted(launch)}, not {key!r}")
        return launch, key
    if module_name == "harness":  # the suite's own switches
        module = S
    else:
        try:
            module = importlib.import_module(f"cat_fast.{module_name}")
        except ImportError:
            raise SystemExit(f"--setting {setting!r}: no cat_fast.kernels.triton.{module_name}.LAUNCH and no module "
                             f"cat_fast.{module_name}") from None
    if not key.isupper() or key not in vars(module):
        raise SystemExit(f"--setting {setting!r}: {module.__name__} has no module-level setting {key!r}")
    return vars(module), key


def _value(text):
    """A command-line value as the setting takes it: true, false, none, an int, a float, or a string written
    ``str:TEXT``."""
    if text.startswith("str:"):
        return text[4:]
    named = {"true": True, "false": False, "none": None}
    if text.lower() in named:
        return named[text.lower()]
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected true, false, none, an int, a float or str:TEXT, "
                                         f"got {text!r}") from None


def _values(text, n):
    """A --values entry: n comma-separated values, one per setting."""
    parts = text.split(",")
    if len(parts) != n:
        raise SystemExit(f"--values {text!r}: expected {n} comma-separated values, one per setting")
    try:
        return tuple(_value(part) for part in parts)
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"--values {text!r}: {e}") from None


@contextlib.contextmanager
def _set(settings, values):
    saved = [launch[key] for launch, key in settings]
    for (launch, key), value in zip(settings, values):
        launch[key] = value
    try:
        yield
    finally:
        for (launch, key), value in zip(settings, saved):
            launch[key] = value


def _time(step, steps):
    with torch.autocast("cuda", torch.bfloat16):
        return round(time_steps(step, 5, steps)[0], 3)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("sizes", nargs="+", metavar="BxT")
    p.add_argument("--setting", required=True,
                   help="module.key of a cat_fast.kernels.triton LAUNCH entry, or dotted.module.NAME of cat_fast; "
                        "several, comma-separated, are set together")
    p.add_argument("--values", nargs="+", required=True,
                   help="the values to compare (true, false, none, ints or floats); with several settings, each "
                        "comma-separated, one per setting")
    p.add_argument("--method", nargs="+", default=["plain_fast_captured"], choices=S.METHODS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cat-layers", type=int, nargs="+", default=None,
                   help="CAT's mixing layer fixed, one step per value and layer given (CAT methods only)")
    args = p.parse_args()
    if args.cat_layers and not any(m.startswith("cat") for m in args.method):
        p.error("--cat-layers: expected a CAT method among --method (cat_captured)")
    settings = [_launch(setting) for setting in args.setting.split(",")]
    arms = {text: _values(text, len(settings)) for text in args.values}
    if not torch.cuda.is_available():
        sys.exit("launch_ab.py: needs a CUDA GPU")
    if each_size_apart(__file__, args.sizes, sys.argv[1:]):
        return
    values = list(arms)
    for size in args.sizes:
        peer = S.build_step("plain_compiled_ro", size)[2]
        # (method, CAT's fixed layer or None: the suite's drawn ones)
        rows = [(m, layer) for m in args.method
                for layer in (args.cat_layers if args.cat_layers and m.startswith("cat") else [None])]
        steps = {}
        for m, layer in rows:
            for v in values:
                with _set(settings, arms[v]):
                    steps[m, layer, v] = S.build_step(m, size, None if layer is None else [layer])[2]
                    _time(steps[m, layer, v], 3)  # captured with the setting in force
        peer_ms, medians = [], {key: [] for key in steps}
        for _ in range(args.rounds):
            peer_ms.append(_time(peer, args.steps))
            for (m, layer, v), step in steps.items():
                with _set(settings, arms[v]):
                    medians[m, layer, v].append(_time(step, args.steps))
        ref = statistics.median(peer_ms)
        for m, layer in rows:
            row = {"size": size, "method": m, "setting": args.setting, "peer_ms": peer_ms,
                   "median_ms": {v: medians[m, layer, v] for v in values},
                   "x_peer": {v: round(statistics.median(medians[m, layer, v]) / ref, 3) for v in values}}
            if layer is not None:
                row["cat_layer"] = layer
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
