"""One BERT-base encoder layer's forward + backward (input and parameter gradients), bf16 autocast, train mode:
the model's own layer against `cat_fast.layers.training`, host time (issuing the calls) and GPU time (CUDA events
around the call, queued behind a spin kernel so that they time the kernels, not the host) per call, medians over
interleaved calls. ``--compiled`` adds ``torch.compile(layer)`` (default mode, compiled before the timing): what
the compiler's fusion of the layer's elementwise work gives against the training layer; the training
layer runs with its fused Triton elementwise kernels ("training", at every size: `FUSED_MIN_ROWS` set to 0) and
without ("unfused", `FUSED = False`); each
row also gives the layer's matmul FLOPs over the GPU time.

    python benchmarks/tools/training_layer_host.py [--sizes 8x128 32x128 64x256] [--calls 30] [--compiled]
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
from cat_fast import models  # noqa: E402
from cat_fast.layers import training as training_layer  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", default=["8x128", "32x128", "64x256"])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--compiled", action="store_true", help="also torch.compile(layer)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("training_layer_host.py needs a CUDA device")
    model = S.make_model("sdpa").train()
    layer = models.structure(model).layer_modules[5]
    assert training_layer.supported(layer)

    def own(x, mask):
        out = layer(x, mask)
        return out[0] if isinstance(out, tuple) else out

    def fused(x, mask):  # at every size: the row threshold (`FUSED_MIN_ROWS`) is what this measures
        threshold, training_layer.FUSED_MIN_ROWS = training_layer.FUSED_MIN_ROWS, 0
        try:
            return training_layer.forward(layer, (x, mask), {})
        finally:
            training_layer.FUSED_MIN_ROWS = threshold

    def unfused(x, mask):
        training_layer.FUSED = False
        try:
            return training_layer.forward(layer, (x, mask), {})
        finally:
            training_layer.FUSED = True

    versions = [("own", own), ("unfused", unfused), ("training", fused)]
    if args.compiled:
        compiled_layer = torch.compile(layer)

        def compiled(x, mask):
            out = compiled_layer(x, mask)
            return out[0] if isinstance(out, tuple) else out

        versions.append(("compiled", compiled))
    cfg = model.config
    D, I = cfg.hidden_size, cfg.intermediate_size  # noqa: E741
    print(f"== one layer fwd + bwd (bf16 autocast, dropout on), median of {args.calls} interleaved calls, ms; "
          "matmul TFLOP/s = the layer's matmul FLOPs (forward 2·tokens·(4D² + 2DI) + 4·B·T²·D, backward 2×) / GPU time")
    print(f"   {'size':8s} {'version':10s} {'host':>7s} {'GPU':>7s} {'TFLOP/s':>8s}")
    for size in args.sizes:
        B, T = H.dims(size)
        batch, _ = S.make_batch(B, T, model.config.vocab_size)
        mask = models.inputs._padding_mask_4d(batch["attention_mask"])
        x = torch.randn(B, T, model.config.hidden_size, device="cuda", requires_grad=True)
        g = torch.randn_like(x)
        times = {name: ([], []) for name, _ in versions}
        flops = 3 * (2 * B * T * (4 * D * D + 2 * D * I) + 4 * B * T * T * D)
        for k in range(args.calls + 3):
            for name, run in (versions if k % 2 else versions[::-1]):
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(100_000_000)  # the GPU waits while the host issues: events time the kernels
                t0 = time.perf_counter()
                start.record()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = run(x, mask)
                y.backward(g)
                end.record()
                host = (time.perf_counter() - t0) * 1e3
                torch.cuda.synchronize()
                if k >= 3:
                    times[name][0].append(host)
                    times[name][1].append(start.elapsed_time(end))
                x.grad = None
                layer.zero_grad(set_to_none=True)
        for name, (host, gpu) in times.items():
            ms = statistics.median(gpu)
            print(f"   {size:8s} {name:10s} {statistics.median(host):7.3f} {ms:7.3f} {flops / ms / 1e9:8.1f}")


if __name__ == "__main__":
    main()
