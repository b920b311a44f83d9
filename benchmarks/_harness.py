"""Shared machinery of the benchmark suite: timing, byte counts, kernel-launch counting, recording.

Timing
------
* CUDA: every repetition is bracketed by its own pair of CUDA events; before each repetition a 256
  MiB buffer is read (outside the events) so the inputs do not sit in L2 (H100/H200 L2 is 50 MB) and
  the lines left in L2 are clean: the write-backs of earlier outputs happen there, not inside the
  timed call (zeroing the buffer instead, as `triton.testing.do_bench` does, leaves up to an L2 of
  dirty lines whose write-back is charged to the next timed kernel). Warm-up calls (which also
  absorb Triton JIT / autotuning and torch.compile) are not timed. The median over the repetitions
  is reported (and the min, for reference).
* CPU: `time.perf_counter` around each repetition, median reported.

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
import math
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


def run_cpu_set():
    """The small CPU set runs on machines without CUDA, or everywhere with CAT_FAST_BENCH_CPU=1."""
    return (not HAS_CUDA) or os.environ.get("CAT_FAST_BENCH_CPU", "0") == "1"


CPU_SET_SKIP_REASON = "CPU set runs only without CUDA (set CAT_FAST_BENCH_CPU=1 to force it)"


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
            seconds, extra = 0.0, {"error": _describe(error)}
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


def _describe(error):
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


def cpu_threads():
    """Threads of the CPU set: CAT_FAST_BENCH_CPU_THREADS, default 1 (a shared, loaded CI machine makes
    the intra-op thread pool of small ops pathologically slow; single-threaded numbers are stable)."""
    return max(1, env_int("CAT_FAST_BENCH_CPU_THREADS", 1))


def time_cpu(fn, warmup=2, reps=10):
    previous = torch.get_num_threads()
    torch.set_num_threads(cpu_threads())
    try:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    finally:
        torch.set_num_threads(previous)
    return statistics.median(times), min(times)


def time_fn(fn, device, warmup=None, reps=None):
    if device == "cuda":
        return time_cuda(fn, warmup=warmup or env_int("CAT_FAST_BENCH_WARMUP", 5), reps=reps or env_int("CAT_FAST_BENCH_REPS", 20))
    return time_cpu(fn, warmup=warmup or 2, reps=reps or 10)


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


# ----------------------------------------------------------------------------- launch counting


def count_cuda_launches(fn):
    """Device-side activities (kernels, memcpy, memset) launched by one call of `fn`, via torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if getattr(e, "device_type", None) == DeviceType.CUDA]
    return len(names), names


# ----------------------------------------------------------------------------- op cases

BACKENDS_GPU = ("triton", "cuda", "reference", "compile")
BACKENDS_CPU = ("cpp", "reference")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

_COMPILED = {}


def _configure_dynamo():
    import torch._dynamo

    for key in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, max(getattr(torch._dynamo.config, key), 256))


def compiled_reference(op_name):
    """torch.compile of the pure-PyTorch reference (default mode; automatic dynamic shapes)."""
    if op_name not in _COMPILED:
        import cat_fast.kernels.reference as reference

        _configure_dynamo()
        _COMPILED[op_name] = torch.compile(getattr(reference, op_name))
    return _COMPILED[op_name]


def backend_fn(op_name, backend):
    """(callable, context manager factory) for running `op_name` on `backend`.

    `reference` = the public op under use_backend("reference") (so validation costs are the same
    as for the fused backends); `compile` = torch.compile(cat_fast.kernels.reference.<op>).
    """
    import cat_fast
    import cat_fast.ops as ops

    if backend == "compile":
        return compiled_reference(op_name), contextlib.nullcontext
    return getattr(ops, op_name), (lambda: cat_fast.use_backend(backend))


def backend_skip_reason(backend, device):
    """Why `backend` cannot run on `device` here, or None."""
    import cat_fast

    if device == "cuda" and not HAS_CUDA:
        return NO_CUDA_REASON
    if device == "cpu" and not run_cpu_set():
        return CPU_SET_SKIP_REASON
    if backend == "compile":
        if os.environ.get("CAT_FAST_BENCH_COMPILE", "1") == "0":
            return "torch.compile cases disabled (CAT_FAST_BENCH_COMPILE=0)"
        return None
    if backend not in cat_fast.backends():
        errors = cat_fast.ops.registry.load_errors()
        return f"backend {backend} not available: {errors.get(backend, 'not built')}"
    return None


def op_measure(op_name, backend, device, forward, grad_inputs=None, grad_outputs=None, bytes_fwd=0, bytes_bwd=0,
               count_launches=False):
    """Build the measure() closure of an op case.

    forward(fn) runs the op once and returns the tensor(s) to differentiate; with grad_inputs the
    fwd+bwd timing runs forward then `torch.autograd.grad(out, grad_inputs, grad_outputs)` (no .grad
    accumulation). Returns (seconds of fwd+bwd (or fwd alone), extra_info).
    """

    def backward(out):
        return torch.autograd.grad(out, grad_inputs, grad_outputs)

    def measure():
        fn, ctx = backend_fn(op_name, backend)
        extra = {"op": op_name, "backend": backend, "device": device, "bytes_fwd": bytes_fwd, "bytes_bwd": bytes_bwd}
        if device == "cpu":
            extra["cpu_threads"] = cpu_threads()
        with ctx():
            fwd_ms, fwd_min = time_fn(lambda: forward(fn), device)
            extra.update(fwd_ms=fwd_ms, fwd_min_ms=fwd_min, fwd_gbps=bytes_fwd / (fwd_ms * 1e-3) / 1e9)
            total_ms, total_bytes = fwd_ms, bytes_fwd
            if grad_inputs is not None:
                fb_ms, fb_min = time_fn(lambda: backward(forward(fn)), device)
                total_ms, total_bytes = fb_ms, bytes_fwd + bytes_bwd
                extra.update(fwdbwd_ms=fb_ms, fwdbwd_min_ms=fb_min)
            extra["gbps"] = total_bytes / (total_ms * 1e-3) / 1e9
            extra["bytes_total"] = total_bytes
            if device == "cuda":
                copy = copy_bandwidth_gbps()
                extra["copy_gbps"] = copy
                extra["pct_copy_bw"] = 100.0 * extra["gbps"] / copy
                reps = env_int("CAT_FAST_BENCH_REPS", 20)
                call = (lambda: backward(forward(fn))) if grad_inputs is not None else (lambda: forward(fn))
                gpu_ms, _ = time_cuda(call, warmup=2, reps=reps, host_ahead=True)
                extra["gpu_ms"] = gpu_ms
                extra["gpu_gbps"] = total_bytes / (gpu_ms * 1e-3) / 1e9
                extra["pct_copy_bw_gpu"] = 100.0 * extra["gpu_gbps"] / copy
                if count_launches:
                    extra.update(_launches(lambda: forward(fn), backward if grad_inputs is not None else None))
        return total_ms * 1e-3, extra

    return measure


def _launches(forward, backward):
    out = {}
    try:
        out["launches_fwd"], names = count_cuda_launches(forward)
        out["launch_names_fwd"] = names[:12]
        if backward is not None:
            result = forward()  # the forward outside the profiler, only the backward inside it
            out["launches_bwd"], names = count_cuda_launches(lambda: backward(result))
            out["launch_names_bwd"] = names[:12]
    except Exception as error:
        out["launch_error"] = _describe(error)
    return out


def finish(info):
    """Fail the test (after recording) when the case errored."""
    import pytest

    if "error" in info:
        if is_oom(info):
            pytest.xfail(f"OOM: {info['error'][:200]}")
        pytest.fail(info["error"], pytrace=False)


def nan_to_none(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


# ----------------------------------------------------------------------------- parametrisation

# [B, T, D] of the op benchmarks (issue: sizes of BERT-base / -large activations).
SIZES_BTD_GPU = ("32x128x768", "64x256x768", "64x512x1024")
SIZES_BTD_CPU = ("4x16x64", "8x64x128")
# [N, C] logits: B rows with C = 2..3 classes as in training, B*T rows x 3 (bandwidth), and 2^20 x 3.
SIZES_NC_GPU = ("32x2", "64x3", "4096x3", "16384x3", "32768x3", "1048576x3")
SIZES_NC_CPU = ("8x2", "4096x3")


def dims(size):
    return tuple(int(x) for x in size.split("x"))


def op_params(gpu_sizes, cpu_sizes, gpu_dtypes=("fp32", "bf16"), cpu_dtypes=("fp32",)):
    """pytest params (device, backend, size, dtype) for the GPU set and the small CPU set, with skip marks."""
    import pytest

    params = []
    for device, sizes, dtypes, backends in (
        ("cuda", gpu_sizes, gpu_dtypes, BACKENDS_GPU),
        ("cpu", cpu_sizes, cpu_dtypes, BACKENDS_CPU),
    ):
        for size in sizes:
            for dtype in dtypes:
                for backend in backends:
                    marks = [pytest.mark.bench_ops]
                    reason = backend_skip_reason(backend, device)
                    if reason:
                        marks.append(pytest.mark.skip(reason=reason))
                    params.append(
                        pytest.param(device, backend, size, dtype, id=f"{device}-{size}-{dtype}-{backend}", marks=marks)
                    )
    return params


OP_ARGNAMES = "device,backend,size,dtype"
