"""Timing of step closures: CUDA events around each step on the GPU (perf_counter on the CPU), one synchronisation
after a block of steps, median reported.

`time_steps`: warm-up steps, then the timed steps (peak memory over them on the GPU). `time_paired`: the step and
a plain step interleaved (blocks of ``2 * steps // rounds`` steps, the order flipped every round, in steady state):
the small-batch steps are host-bound and the host's speed drifts (benchmarks/RESULTS.md, "Rows"), so a fine
interleave puts the drift on both steps alike. A step that records its mixing layer per call (``step.layers``,
CAT) is also summarised per drawn layer (`by_layer`, `layer_mean`).
"""
import statistics
import time

import torch

from benchmarks.steps.setting import DEVICE, LAYERS, sync


class _HostMark:
    """CPU stand-in for a CUDA timing event."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def mark():
    """A timing mark: a CUDA event on the GPU, a perf_counter reading on the CPU."""
    return torch.cuda.Event(enable_timing=True) if DEVICE == "cuda" else _HostMark()


def _timed(step, n):
    """(start, end) marks around each of `n` calls of `step`, not yet synchronised."""
    marks = [(mark(), mark()) for _ in range(n)]
    for start, end in marks:
        start.record()
        step()
        end.record()
    return marks


def _ms(marks):
    return [start.elapsed_time(end) for start, end in marks]


def _drawn(step):
    """The mixing layers `step` has recorded so far (a copy), or None when it records none."""
    layers = getattr(step, "layers", None)
    return None if layers is None else list(layers)


def _drawn_since(step, before):
    return None if before is None else step.layers[len(before):]


def by_layer(times, layers):
    """{m: (median ms of the calls that drew m, calls)}, or None when the step drew no layer."""
    if not layers:
        return None
    groups = {}
    for t, m in zip(times, layers):
        groups.setdefault(m, []).append(t)
    return {m: (statistics.median(ts), len(ts)) for m, ts in sorted(groups.items())}


def layer_mean(per_layer):
    """The mean over the drawn layers of their median step: the expected cost of a step whose layer is drawn
    uniformly (the FLOP count's mean m), without the median of a 3-mode mixture jumping between modes with the
    draws that happened to land in the timed window. None unless every one of LAYERS was drawn."""
    if per_layer is None or sorted(per_layer) != sorted(LAYERS):
        return None
    return statistics.fmean(ms for ms, _ in per_layer.values())


def time_steps(step, warmup, steps):
    """(median ms, min ms, peak MiB or None, by_layer) of `steps` timed calls after `warmup` calls."""
    for _ in range(warmup):
        step()
    sync()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = _drawn(step)
    marks = _timed(step, steps)
    sync()
    times = _ms(marks)
    peak = torch.cuda.max_memory_allocated() / 2**20 if DEVICE == "cuda" else None
    return statistics.median(times), min(times), peak, by_layer(times, _drawn_since(step, before))


def time_paired(step, plain_step, warmup, steps, rounds=20):
    """(median of `step`, median of a plain step, `step`'s by_layer), the two interleaved (module docstring)."""
    for _ in range(warmup):
        plain_step()
        step()
    sync()
    per_round = max(1, (2 * steps) // rounds)
    before = _drawn(step)
    marks = {step: [], plain_step: []}
    for r in range(rounds):
        for fn in ((plain_step, step) if r % 2 == 0 else (step, plain_step)):
            marks[fn] += _timed(fn, per_round)
    sync()
    times, plain_times = _ms(marks[step]), _ms(marks[plain_step])
    return statistics.median(times), statistics.median(plain_times), by_layer(times, _drawn_since(step, before))
