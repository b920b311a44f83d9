"""Where a training step's GPU time goes: torch.profiler over a few steps of each method (the step benchmark's
model, batch and step closures), kernels summed by name and by kind (matmul, attention, elementwise, ...).

    python benchmarks/tools/profile_step.py [--size 64x256] [--steps 3] [--host] [--dump DIR] [--cat-layer M]
        [--packed] [methods...]

Prints, per method, GPU kernel time per step (sum of kernel durations; overlapping streams would count twice),
the CUDA-event step time, and the top kernels. CUDA-graph replays are traced kernel by kernel (CUPTI). GPU only.
``--host`` also records the host (aten ops, Python frames) and attributes the GPU's idle gaps to what the host
ran meanwhile (`benchmarks/tools/trace_gaps.py`), and counts Python garbage-collection pauses over the timed steps.
"""
import argparse
import collections
import gc
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
from benchmarks.steps import harness as S  # noqa: E402
from benchmarks.steps.timing import time_steps  # noqa: E402
from benchmarks.tools.trace_gaps import idle_gaps  # noqa: E402

KINDS = (("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")),
         ("attention", ("fmha", "flash", "attention", "efficient")),
         ("softmax/norm", ("softmax", "layer_norm", "layernorm", "norm")),
         ("adam", ("adam", "multi_tensor")),
         ("cat_fast", ("cmix", "crm", "cal_", "gs_cos")),
         ("copy/cat", ("copy", "cat", "memcpy", "fill", "memset")),
         ("reduce", ("reduce",)))


def kind_of(name):
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "elementwise/other"


def kernel_times(prof, runs):
    """(µs per run by kernel name, kernels per run by name, µs per run by kind, [(start, end, name)]) of the GPU
    activities a torch.profiler session recorded over `runs` repetitions."""
    by_name, count, by_kind, spans = collections.Counter(), collections.Counter(), collections.Counter(), []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        by_name[event.name] += us / runs
        count[event.name] += 1 / runs
        by_kind[kind_of(event.name)] += us / runs
        spans.append((event.time_range.start, event.time_range.end, event.name))
    return by_name, count, by_kind, spans


def busy_time(spans):
    """(union length of the (start, end, name) intervals, last end - first start), in the spans' unit."""
    if not spans:
        return 0, 0
    gaps, first, last = idle_gaps(spans)
    return (last - first) - sum(end - start for start, end, _, _ in gaps), last - first


class GcPauses:
    """Python garbage-collection pauses (count, total ms) while active."""

    def __init__(self):
        self.count, self.ms, self._t0 = 0, 0.0, None

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.count += 1
            self.ms += (time.perf_counter() - self._t0) * 1e3
            self._t0 = None

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def profile(method, size, steps, trace_dir=None, host=False, dump=None, layers=None):
    model, optimizer, step = S.build_step(method, size, layers)
    if hasattr(step, "prime"):  # cat_captured: every mixing layer's graph captured before the timed steps
        step.prime()
    with GcPauses() as pauses:
        median_ms = time_steps(step, 5, 10)[0]
    activities = [torch.profiler.ProfilerActivity.CUDA]
    if host:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=activities, with_stack=host) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by_name, count, by_kind, spans = kernel_times(prof, steps)
    launches = len(spans)
    total = sum(by_kind.values()) / 1e3
    busy, window = busy_time(spans)
    print(f"\n== {method} {size}: step {median_ms:.2f} ms (CUDA events, median of 10), "
          f"kernels {total:.2f} ms/step, {launches / steps:.0f} kernels/step; GPU busy {busy / steps / 1e3:.2f} "
          f"of {window / steps / 1e3:.2f} ms/step (union of kernel intervals / first start to last end)")
    print(f"   Python GC over the 15 warm-up + timed steps: {pauses.count} pauses, {pauses.ms:.2f} ms")
    captured = getattr(step, "captured", None)
    if captured is not None:  # which graphs the steps replayed (a step that replayed none ran eagerly)
        print(f"   CapturedStep: {captured.num_graphs} graphs ({captured.num_packed_graphs} with packed rows), "
              f"{captured.num_replays} replayed steps")
    if trace_dir or host:
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
        path = os.path.join(trace_dir or tempfile.gettempdir(), f"trace-{method}-{size}.json")
        prof.export_chrome_trace(path)
        if host:
            gaps = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trace_gaps.py")
            subprocess.run([sys.executable, gaps, path, "--steps", str(steps)], check=False)
    print("   by kind: " + ", ".join(f"{k} {v / 1e3:.2f}" for k, v in by_kind.most_common()))
    for name, us in by_name.most_common(14):
        print(f"   {us / 1e3:7.3f} ms  {name[:150]}")
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, f"kernels-{method}-{size}.tsv"), "w") as f:
            f.write("us_per_step\tcalls_per_step\tkind\tname\n")
            for name, us in by_name.most_common():
                f.write(f"{us:.2f}\t{count[name]:.2f}\t{kind_of(name)}\t{name}\n")
    del model, optimizer, step
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="*", default=["plain", "plain_first_token", "cat", "cat_full_last"])
    parser.add_argument("--size", default="64x256")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trace-dir", default=None, help="write a Chrome trace per method there")
    parser.add_argument("--host", action="store_true", help="record the host too and attribute the GPU idle gaps")
    parser.add_argument("--dump", default=None, help="write every kernel (µs and calls per step, kind) as a TSV there")
    parser.add_argument("--cat-layer", type=int, default=None,
                        help="CAT's mixing layer fixed to this one (default: the suite's set, one drawn per step)")
    parser.add_argument("--packed", action="store_true", help="the training layers' packed path wherever it applies "
                        "(layers.training.PACKED = True: CAT's captured step too)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_step.py needs a CUDA device")
    if args.packed:
        from cat_fast.layers import training

        training.PACKED = True
    layers = None if args.cat_layer is None else [args.cat_layer]
    for method in args.methods:
        profile(method, args.size, args.steps, args.trace_dir, args.host, args.dump, layers)


if __name__ == "__main__":
    main()
