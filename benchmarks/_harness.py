"""Shared machinery of the benchmark suite: the environment, recording, GPU timing, copy bandwidth.

The op cases (backends, sizes, CPU timing, launch counting) are in `benchmarks/ops/harness.py`, the step cases'
builders in `benchmarks/steps/harness.py`.

Timing
------
* CUDA: every repetition is bracketed by its own pair of CUDA events; before each repetition a 256
  MiB buffer is read (outside the events) so the inputs do not sit in L2 (H100/H200 L2 is 50 MB) and
  the lines left in L2 are clean: the write-backs of earlier outputs happen there, not inside the
  timed call (zeroing the buffer instead, as `triton.testing.do_bench` does, leaves up to an L2 of
  dirty lines whose write-back is charged to the next timed kernel). Warm-up calls (which also
  absorb Triton JIT / autotuning and torch.compile) are not timed. The median over the repetitions
  is reported (and the min, for reference).
* CPU: `time.perf_counter` around each repetition, median reported (`benchmarks/ops/harness.time_cpu`).

Recording
---------
Each case calls `record(benchmark, measure)`: `measure()` returns (seconds, extra_info). It runs
inside `benchmark.pedantic(rounds=1)` with a *virtual clock* as pytest-benchmark's timer (see
`virtual_clock`), so pytest-benchmark's own stats (min/median/mean of its single round) ARE the
event-measured median, and `--benchmark-json` keeps it. Everything else (fwd/bwd times, GB/s,
launch counts, errors) goes to `benchmark.extra_info`. When CAT_FAST_BENCH_JSONL is set each
record is also appended to that file as soon as it is measured (a backup if the run is killed).
"""
import contextlib
import json
import os
import statistics
import time
import traceback

import torch

# ----------------------------------------------------------------------------- environment

HAS_CUDA = torch.cuda.is_available()
NO_CUDA_REASON = "no CUDA device: GPU benchmark cases run only on a CUDA machine"


def env_int(name, default):
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def deadline_passed(kind):
    """Time-budget guard: CAT_FAST_BENCH_DEADLINE_OPS / _STEP hold a UNIX time after which cases skip."""
    value = os.environ.get(f"CAT_FAST_BENCH_DEADLINE_{kind.upper()}")
    return value is not None and time.time() > float(value)


# ----------------------------------------------------------------------------- virtual clock


class _Clock:
    now = 0.0


def virtual_clock():
    """pytest-benchmark timer: advances only by the seconds a measurement reports."""
    return _Clock.now


def record(benchmark, measure, group=None, **info):
    """Run `measure()` once under pytest-benchmark; returns the extra_info dict.

    `measure()` -> (seconds, extra). Exceptions are caught and recorded as extra_info["error"]
    (seconds = 0) so one failing case never loses the others; the caller decides whether to fail.
    """
    box = dict(info)

    def target():
        try:
            seconds, extra = measure()
        except Exception as error:  # recorded, the caller re-raises as a test failure
            seconds, extra = 0.0, {"error": describe(error)}
            if HAS_CUDA:
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
        box.update(extra)
        _Clock.now += float(seconds)

    if group is not None:
        benchmark.group = group
    benchmark.pedantic(target, rounds=1, iterations=1, warmup_rounds=0)
    benchmark.extra_info.update(box)
    _append_jsonl(benchmark, box)
    return box


def describe(error):
    """One line naming `error` and the last frames it came through."""
    tb = traceback.extract_tb(error.__traceback__)
    where = "; ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in tb[-4:])
    text = f"{type(error).__name__}: {error}".strip()
    if len(text) > 600:
        text = text[:600] + " ..."
    return f"{text} [at {where}]"


def _append_jsonl(benchmark, info):
    path = os.environ.get("CAT_FAST_BENCH_JSONL")
    if not path:
        return
    node_params = getattr(benchmark, "params", None) or {}
    row = {
        "name": getattr(benchmark, "name", None),
        "fullname": getattr(benchmark, "fullname", None),
        "group": getattr(benchmark, "group", None),
        "params": {k: str(v) for k, v in node_params.items()},
        "extra_info": info,
    }
    with contextlib.suppress(OSError):
        with open(path, "a") as handle:
            handle.write(json.dumps(row, default=str) + "\n")


def is_oom(info):
    return "OutOfMemoryError" in str(info.get("error", "")) or "out of memory" in str(info.get("error", ""))


# ----------------------------------------------------------------------------- timing

_FLUSH = {}


def _flush_buffer(device):
    if device not in _FLUSH:
        _FLUSH[device] = torch.zeros(64 * 1024 * 1024, dtype=torch.int32, device=device)  # 256 MiB
    return _FLUSH[device]


def evict_l2(device=None):
    """Fills L2 with clean lines of a 256 MiB buffer by reading it (module docstring: why not writing it)."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    torch.amax(_flush_buffer(device))


HOST_AHEAD_CYCLES = 4_000_000  # ~2 ms of GPU clock: longer than the host needs to enqueue one op call


def time_cuda(fn, warmup=5, reps=20, flush=True, host_ahead=False):
    """Median (and min) milliseconds of `fn()` with CUDA events, L2 evicted (`evict_l2`) before each rep.

    ``host_ahead=True``: a spin kernel (`torch.cuda._sleep`) is queued before the start event, so the host has
    enqueued all of fn's work before the GPU reaches it — the time is the GPU's (kernels and the gaps between
    them), not the Python/dispatch latency of the call, which a training step overlaps with earlier GPU work."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    device = torch.device("cuda", torch.cuda.current_device())
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        if flush:
            evict_l2(device)
        if host_ahead:
            torch.cuda._sleep(HOST_AHEAD_CYCLES)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return statistics.median(times), min(times)


# ----------------------------------------------------------------------------- copy bandwidth

_COPY = {}


def copy_bandwidth_gbps(mib=512, reps=20):
    """Device-to-device copy bandwidth, GB/s counting bytes read + written (median of `reps`), timed as the ops
    are (`time_cuda`: L2 evicted, clean, before each rep)."""
    if "gbps" in _COPY:
        return _COPY["gbps"]
    src = torch.empty(mib * 1024 * 1024 // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    median_ms, _ = time_cuda(lambda: dst.copy_(src), warmup=3, reps=reps, host_ahead=True)
    gbps = 2 * src.numel() * src.element_size() / (median_ms * 1e-3) / 1e9
    src = dst = None  # the lambda's closure holds them: free both before empty_cache
    torch.cuda.empty_cache()
    _COPY["gbps"] = gbps
    _COPY["bytes"] = 2 * mib * 1024 * 1024
    return gbps


def measured_copy_bandwidth():
    return dict(_COPY)


def finish(info):
    """Fail the test (after recording) when the case errored."""
    import pytest

    if "error" in info:
        if is_oom(info):
            pytest.xfail(f"OOM: {info['error'][:200]}")
        pytest.fail(info["error"], pytrace=False)


def dims(size):
    """(B, T[, D]) of a size written "BxT[xD]"."""
    return tuple(int(x) for x in size.split("x"))
