"""Host time against GPU time per phase of a training step in steady state (no synchronisation between steps):
where a host-bound step spends its host time (forward up to the loss, the ``loss.backward()`` call, the optimizer
step), beside the GPU's step period. The methods run interleaved, a block of steps each per round, so that they
share the host's minutes.

    python benchmarks/tools/host_split.py [--size 8x128] [--steps 10] [--rounds 6] [methods...]

Methods: those of the step suite (`benchmarks/steps/harness.py`), and ``gs_pooled_full`` (GS pooled with ``prune_last_layer=False``).
Also reports, per method, whether one step runs under ``torch.cuda.set_sync_debug_mode("error")``. GPU only
(``CAT_FAST_BENCH_STEP_CPU=1`` without CUDA: the tiny CPU model, host clock only, a smoke test of this script).
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
from benchmarks import _harness as H  # noqa: E402
from benchmarks.steps import harness as S  # noqa: E402
from benchmarks.steps.setting import CPU_SMOKE, DEVICE, sync  # noqa: E402
from benchmarks.steps.timing import mark  # noqa: E402

PHASES = ("forward", "backward", "optimizer", "rest")


class Marks:
    def __init__(self):
        self.host = {}

    def mark(self, name):
        self.host[name] = time.perf_counter()


MARKS = Marks()


def instrument():
    backward, step = torch.Tensor.backward, torch.optim.AdamW.step

    def timed_backward(self, *args, **kwargs):
        MARKS.mark("backward >")
        out = backward(self, *args, **kwargs)
        MARKS.mark("backward <")
        return out

    def timed_step(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        MARKS.mark("optimizer <")
        return out

    torch.Tensor.backward = timed_backward
    torch.optim.AdamW.step = timed_step


def build(method, size):
    if method != "gs_pooled_full":
        return S.build_step(method, size)
    model, optimizer, _ = S.build_step("plain", size)
    batch, pairs = S.make_batch(*H.dims(size), model.config.vocab_size)
    step = S.objective_step("gs", model, optimizer, batch, pairs, **S.SPECS["gs_pooled"].kwargs,
                            prune_last_layer=False)
    return model, optimizer, step


def sync_free(step):
    if DEVICE != "cuda":
        return "(no CUDA)"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return "no host sync"
    except RuntimeError as error:
        return f"host sync: {str(error).splitlines()[0][:100]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def block(step, n):
    """Per step: host ms per phase and the GPU period (ms between consecutive step starts on the stream)."""
    events = [mark() for _ in range(n + 1)]
    host = []
    for k in range(n):
        events[k].record()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        h = MARKS.host
        host.append((h["backward >"] - t0, h["backward <"] - h["backward >"], h["optimizer <"] - h["backward <"],
                     t1 - h["optimizer <"]))
    events[n].record()
    sync()
    gpu = [events[k].elapsed_time(events[k + 1]) for k in range(n)]
    return [[v * 1e3 for v in row] for row in host], gpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="*", default=["plain", "plain_first_token", "plain_training_layers", "gs_pooled",
                                                         "gs_pooled_hf_layers"])
    parser.add_argument("--size", default="8x128")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if DEVICE != "cuda" and not CPU_SMOKE:
        sys.exit("host_split.py needs a CUDA device (or CAT_FAST_BENCH_STEP_CPU=1 for a CPU smoke run)")
    instrument()
    built = {m: build(m, args.size) for m in args.methods}
    syncs = {}
    for m, (_, _, step) in built.items():
        for _ in range(5):
            step()
        syncs[m] = sync_free(step)
    host = {m: [] for m in built}
    gpu = {m: [] for m in built}
    for _ in range(args.rounds):
        for m, (_, _, step) in built.items():
            step()  # the block starts behind another method's queue: one step to reach its own steady state
            h, g = block(step, args.steps)
            host[m] += h
            gpu[m] += g
    print(f"== {args.size}: median over {args.rounds} rounds x {args.steps} steps, ms; step = GPU period "
          f"between step starts (steady state)")
    print(f"   {'method':20s} " + " ".join(f"{p:>9s}" for p in PHASES) + f" {'host sum':>9s} {'step':>8s} {'ratio':>6s}"
          "  sync check")
    base = statistics.median(gpu[args.methods[0]])
    for m in built:
        cols = [statistics.median(row[i] for row in host[m]) for i in range(len(PHASES))]
        total = statistics.median(sum(row) for row in host[m])
        step_ms = statistics.median(gpu[m])
        print(f"   {m:20s} " + " ".join(f"{c:9.2f}" for c in cols) + f" {total:9.2f} {step_ms:8.2f} "
              f"{step_ms / base:6.3f}  {syncs[m]}")


if __name__ == "__main__":
    main()
