"""Where a training step's GPU time goes: torch.profiler over a few steps of each method (the step benchmark's
model, batch and step closures), kernels summed by name and by kind (matmul, attention, elementwise, ...).

    python benchmarks/profile_step.py [--size 64x256] [--steps 3] [methods...]

Prints, per method, GPU kernel time per step (sum of kernel durations; overlapping streams would count twice),
the CUDA-event step time, and the top kernels. CUDA-graph replays are traced kernel by kernel (CUPTI). GPU only.
"""
import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import test_bench_step as S  # noqa: E402

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


def profile(method, size, steps):
    batch_size, tokens = (int(v) for v in size.split("x"))
    model = S.make_model(S._attn_for(method))
    optimizer = S.make_optimizer(model)
    batch, pairs = S.make_batch(batch_size, tokens, model.config.vocab_size)
    step = S.make_step(method, model, optimizer, batch, pairs)
    median_ms, _, _ = S.time_steps(step, 5, 10)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by_name, by_kind, launches = collections.Counter(), collections.Counter(), 0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        by_name[event.name] += us / steps
        by_kind[kind_of(event.name)] += us / steps
        launches += 1
    total = sum(by_kind.values()) / 1e3
    print(f"\n== {method} {size}: step {median_ms:.2f} ms (CUDA events, median of 10), "
          f"kernels {total:.2f} ms/step, {launches / steps:.0f} kernels/step")
    print("   by kind: " + ", ".join(f"{k} {v / 1e3:.2f}" for k, v in by_kind.most_common()))
    for name, us in by_name.most_common(14):
        print(f"   {us / 1e3:7.3f} ms  {name[:150]}")
    del model, optimizer, step
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="*", default=["plain", "plain_first_token", "cat", "cat_full_last"])
    parser.add_argument("--size", default="64x256")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_step.py needs a CUDA device")
    for method in args.methods:
        profile(method, args.size, args.steps)


if __name__ == "__main__":
    main()
