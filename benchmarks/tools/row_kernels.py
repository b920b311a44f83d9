"""The training layer's row-sum Triton kernels under their launch settings, beside the same work in eager PyTorch and
compiled by ``torch.compile`` (Inductor): LayerNorm backward with the parameter sums
(`residual_layer_norm.backward_with_params`, D = 768), its input-only form (`residual_layer_norm.backward`), GELU
backward with the bias sum (`gelu_bias_backward.backward`, N = 3072), and a sublayer's dropout + residual add +
LayerNorm forward (``dropout_norm``: `residual_layer_norm.forward_with_dropout`, the mask drawn in the kernel,
against `torch.native_dropout` followed by `residual_layer_norm.forward`, and the raw backward against the backward
of the dropped branch), at the rows of BERT-base steps 8x128, 32x128 and 64x256. Each version runs 20 times inside
one CUDA graph (no host in the timing), median of 7 replays; µs per call, and the bytes it must move over the time
as a fraction of the GPU's memory bandwidth (``--peak-tbs``, the H200's 4.8 TB/s by default). Each setting's results
are checked against eager PyTorch first.

    python benchmarks/tools/row_kernels.py [--rows 1024 4096 16384] [--quick]
        [--kernels layer_norm gelu dropout_norm]
"""
import argparse
import itertools
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
from cat_fast.kernels.triton import gelu_bias_backward as gelu  # noqa: E402
from cat_fast.kernels.triton import residual_layer_norm as rln  # noqa: E402

CALLS = 20


def graph_time_us(fn, calls=CALLS):
    """µs per call of `fn()` (no arguments), `calls` calls captured in one CUDA graph, median of 7 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def close(a, b, tol):
    return all(torch.allclose(x.float(), y.float(), rtol=tol, atol=tol) for x, y in zip(a, b))


def report(name, us, nbytes, peak, note=""):
    print(f"  {name:44s} {us:8.2f} µs  {nbytes / (us * 1e-6) / 1e12:5.2f} TB/s "
          f"({100 * nbytes / (us * 1e-6) / (peak * 1e12):4.1f} % of peak){note}", flush=True)


def layer_norm_inputs(n, D=768):
    branch = torch.randn(n, D, device="cuda").to(torch.bfloat16)
    residual = torch.randn(n, D, device="cuda")
    weight = 1 + 0.1 * torch.randn(D, device="cuda")
    bias = 0.1 * torch.randn(D, device="cuda")
    keep = torch.rand(n, D, device="cuda") > 0.1
    grad_y = torch.randn(n, D, device="cuda")
    _, _, mean, rstd = rln.forward(branch, residual, weight, bias, 1e-12)
    return grad_y, branch, residual, weight, mean, rstd, keep, 1 / 0.9


def sweep_layer_norm(n, peak, quick):
    args = layer_norm_inputs(n)
    D = args[3].numel()
    # grad_y, residual fp32 and branch bf16 and keep read; grad_s fp32 and grad_branch bf16 written
    nbytes = n * D * (4 + 4 + 2 + 1 + 4 + 2)
    print(f"LayerNorm backward + parameter sums, {n} x {D}:")
    want = rln.reference_backward_with_params(*args)
    report("eager PyTorch (reference_backward_with_params)",
           graph_time_us(lambda: rln.reference_backward_with_params(*args)), nbytes, peak)
    compiled = torch.compile(rln.reference_backward_with_params)
    compiled(*args)
    report("torch.compile(reference_backward_with_params)", graph_time_us(lambda: compiled(*args)), nbytes, peak)
    rows_options = (1, 2, 4) if quick else (1, 2, 4, 8)
    default = tuple(rln.LAUNCH[k] for k in ("params_rows", "params_min_rows", "params_per_sm", "params_prefetch",
                                            "params_warps"))
    for rows, (min_rows, per_sm), prefetch, warps in itertools.product(
            rows_options, ((16, 4), (8, 4), (8, 8), (4, 8), (32, 2)), (False, True), (None, 8, 16)):
        kw = dict(rows=rows, min_rows=min_rows, per_sm=per_sm, prefetch=prefetch, num_warps=warps)
        ok = close(rln.backward_with_params(*args, **kw), want, 2e-2)
        mark = " *" if (rows, min_rows, per_sm, prefetch, warps) == default else ""
        report(f"fused rows={rows} min_rows={min_rows} per_sm={per_sm} prefetch={int(prefetch)} warps={warps}{mark}",
               graph_time_us(lambda: rln.backward_with_params(*args, **kw)), nbytes, peak,
               "" if ok else "  MISMATCH")
    print(f"LayerNorm backward, input only, {n} x {D}:")
    report("eager PyTorch (reference_backward)", graph_time_us(lambda: rln.reference_backward(*args)), nbytes, peak)
    for rows in (1, 2, 4):
        ok = close(rln.backward(*args, rows=rows), rln.reference_backward(*args), 2e-2)
        report(f"fused rows={rows}", graph_time_us(lambda: rln.backward(*args, rows=rows)), nbytes, peak,
               "" if ok else "  MISMATCH")


def sweep_gelu(n, peak, quick, N=3072):
    grad = torch.randn(n, N, device="cuda").to(torch.bfloat16)
    inner = torch.randn(n, N, device="cuda").to(torch.bfloat16)
    nbytes = n * N * 2 * 3
    print(f"GELU backward + bias sum, {n} x {N}:")
    want = gelu.reference_backward(grad, inner)
    report("eager PyTorch (reference_backward)", graph_time_us(lambda: gelu.reference_backward(grad, inner)), nbytes,
           peak)
    compiled = torch.compile(gelu.reference_backward)
    compiled(grad, inner)
    report("torch.compile(reference_backward)", graph_time_us(lambda: compiled(grad, inner)), nbytes, peak)
    options = list(itertools.product((8, 16, 32, 64), (64, 128, 256, 512), (1, 2, 4, 8), (4, 8), (False, True)))
    if quick:
        options = list(itertools.product((16, 32, 64), (128, 256), (1, 2, 4), (4, 8), (False, True)))
    default = tuple(gelu.LAUNCH[k] for k in ("block_m", "block_n", "per_sm", "num_warps", "tile_sums"))
    if default not in options:
        options.insert(0, default)
    for block_m, block_n, per_sm, warps, tile_sums in options:
        kw = dict(block_m=block_m, block_n=block_n, per_sm=per_sm, num_warps=warps, tile_sums=tile_sums)
        ok = close(gelu.backward(grad, inner, **kw), want, 2e-2)
        mark = " *" if (block_m, block_n, per_sm, warps, tile_sums) == default else ""
        report(f"fused block {block_m}x{block_n} per_sm={per_sm} warps={warps} tile_sums={int(tile_sums)}{mark}",
               graph_time_us(lambda: gelu.backward(grad, inner, **kw)), nbytes, peak, "" if ok else "  MISMATCH")
    report("fused, no bias sum (elementwise only)", graph_time_us(lambda: gelu.backward(grad, inner, False)),
           nbytes, peak)


def sweep_dropout_norm(n, peak, p=0.1, D=768):
    """dropout + residual add + LayerNorm forward (with the 16-bit copy) and its backward with the parameter sums:
    the mask drawn in the LayerNorm kernel against `torch.native_dropout` before it, eager and compiled PyTorch."""
    branch = torch.randn(n, D, device="cuda").to(torch.bfloat16)
    residual = torch.randn(n, D, device="cuda")
    weight = 1 + 0.1 * torch.randn(D, device="cuda")
    bias = 0.1 * torch.randn(D, device="cuda")
    grad_y = torch.randn(n, D, device="cuda")
    key = rln.draw_key(branch.device)
    scale = 1 / (1 - p)
    # the least traffic: branch bf16 and residual fp32 read; y fp32, its bf16 copy and the byte mask written
    nbytes = n * D * (2 + 4 + 4 + 2 + 1)
    print(f"dropout (p = {p}) + residual add + LayerNorm forward, {n} x {D} (bytes: the kernel-drawn form's):")

    def torch_draws():
        dropped, keep = torch.native_dropout(branch, p, True)
        return rln.forward(dropped, residual, weight, bias, 1e-12, out16_dtype=torch.bfloat16), keep

    def eager():
        dropped, keep = torch.native_dropout(branch, p, True)
        return rln.reference_forward(dropped, residual, weight, bias, 1e-12, out16_dtype=torch.bfloat16), keep

    compiled = torch.compile(eager)
    compiled()
    report("eager PyTorch (native_dropout + reference_forward)", graph_time_us(eager), nbytes, peak)
    report("torch.compile(the same)", graph_time_us(compiled), nbytes, peak)
    report("native_dropout + fused forward", graph_time_us(torch_draws), nbytes, peak)
    got = rln.forward_with_dropout(branch, residual, weight, bias, 1e-12, p, key, 0, out16_dtype=torch.bfloat16)
    y, _, mean, rstd, keep = got
    dropped = torch.where(keep, (branch.float() * scale).to(branch.dtype), 0).to(branch.dtype)
    ok = all(torch.equal(a, b) for a, b in zip(got[:4], rln.forward(dropped, residual, weight, bias, 1e-12,
                                                                      out16_dtype=torch.bfloat16)))
    report("fused, the mask drawn in the kernel", graph_time_us(
        lambda: rln.forward_with_dropout(branch, residual, weight, bias, 1e-12, p, key, 0, out16_dtype=torch.bfloat16)),
        nbytes, peak, "" if ok else "  MISMATCH")
    # backward with the parameter sums: grad_y, residual fp32, branch bf16, keep read; grad_s fp32, grad_branch bf16
    nbytes = n * D * (4 + 4 + 2 + 1 + 4 + 2)
    print(f"its backward with the parameter sums, {n} x {D}:")
    args = (grad_y, branch, residual, weight, mean, rstd, keep, scale)
    after = (grad_y, dropped, residual, weight, mean, rstd, keep, scale)
    ok = all(torch.equal(a, b) for a, b in zip(rln.backward_with_params(*args, raw=True),
                                               rln.backward_with_params(*after)))
    report("fused, the dropped branch", graph_time_us(lambda: rln.backward_with_params(*after)), nbytes, peak)
    report("fused, the branch before its dropout (raw=True)",
           graph_time_us(lambda: rln.backward_with_params(*args, raw=True)), nbytes, peak, "" if ok else "  MISMATCH")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", type=int, default=[1024, 4096, 16384])
    parser.add_argument("--peak-tbs", type=float, default=4.8)
    parser.add_argument("--quick", action="store_true", help="fewer settings")
    parser.add_argument("--kernels", nargs="*", choices=("layer_norm", "gelu", "dropout_norm"),
                        default=["layer_norm", "gelu", "dropout_norm"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("row_kernels.py needs a CUDA device")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    torch.manual_seed(0)
    for n in args.rows:
        if "layer_norm" in args.kernels:
            sweep_layer_norm(n, args.peak_tbs, args.quick)
        if "gelu" in args.kernels:
            sweep_gelu(n, args.peak_tbs, args.quick)
        if "dropout_norm" in args.kernels:
            sweep_dropout_norm(n, args.peak_tbs)


if __name__ == "__main__":
    main()
