"""The op benchmarks' cases: backends, sizes and dtypes as pytest params (`op_params`), a case's seeded first input
(`logits_case`, `hidden_case`), and the `measure()` closure of one case (`op_measure`): forward and forward +
backward timed per backend, bytes and bandwidth, launch counts.

Every `benchmarks/ops/test_bench_<op>.py` imports this module alone (`record`, `finish`, `dims` and
`virtual_clock` of `benchmarks/_harness.py` come with it). GPU timing: `_harness.time_cuda` (L2 evicted before each
repetition). CPU: `time.perf_counter` around each repetition, single-threaded by default (`cpu_threads`), median.
"""
import contextlib
import os
import statistics
import time

import torch

from benchmarks._harness import (  # noqa: F401  (dims, finish, record, virtual_clock: for the op files)
    HAS_CUDA,
    NO_CUDA_REASON,
    copy_bandwidth_gbps,
    describe,
    dims,
    env_int,
    finish,
    record,
    time_cuda,
    virtual_clock,
)

BACKENDS_GPU = ("triton", "cuda", "reference", "compile")
BACKENDS_CPU = ("cpp", "reference")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# [B, T, D] of the op benchmarks (issue: sizes of BERT-base / -large activations).
SIZES_BTD_GPU = ("32x128x768", "64x256x768", "64x512x1024")
SIZES_BTD_CPU = ("4x16x64", "8x64x128")
# [N, C] logits: B rows with C = 2..3 classes as in training, B*T rows x 3 (bandwidth), and 2^20 x 3.
SIZES_NC_GPU = ("32x2", "64x3", "4096x3", "16384x3", "32768x3", "1048576x3")
SIZES_NC_CPU = ("8x2", "4096x3")

OP_ARGNAMES = "device,backend,size,dtype"
CPU_SET_SKIP_REASON = "CPU set runs only without CUDA (set CAT_FAST_BENCH_CPU=1 to force it)"


def run_cpu_set():
    """The small CPU set runs on machines without CUDA, or everywhere with CAT_FAST_BENCH_CPU=1."""
    return (not HAS_CUDA) or os.environ.get("CAT_FAST_BENCH_CPU", "0") == "1"


# ----------------------------------------------------------------------------- CPU timing


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


# ----------------------------------------------------------------------------- backends

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


# ----------------------------------------------------------------------------- a case


def logits_case(size, device, dtype):
    """(rows, classes, logits) of an [N, C] case: seed 0, then the logits, 3 * N(0, 1) drawn in fp32 and cast to
    `dtype` (a key of DTYPES), a leaf that requires grad."""
    rows, classes = dims(size)
    torch.manual_seed(0)
    logits = (3 * torch.randn(rows, classes, device=device)).to(DTYPES[dtype]).requires_grad_()
    return rows, classes, logits


def hidden_case(size, device, dtype):
    """(batch, tokens, hidden, h) of a [B, T, D] case: seed 0, then h ~ N(0, 1) drawn in `dtype` (a key of DTYPES),
    a leaf that requires grad."""
    batch, tokens, hidden = dims(size)
    torch.manual_seed(0)
    h = torch.randn(batch, tokens, hidden, device=device, dtype=DTYPES[dtype], requires_grad=True)
    return batch, tokens, hidden, h


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
        out["launch_error"] = describe(error)
    return out


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
