"""Host against GPU along a training step: at marks inside the step (entry and exit of a few functions), the
host's time since the step start and the time at which the GPU reached that point of the stream (a CUDA event
recorded there). Where the GPU time is only a launch latency behind the host's, the GPU had run dry and was
waiting for the host; where it is far behind, the host was ahead. No profiler, so the host runs at full speed.

    python benchmarks/tools/host_timeline.py [--size 64x256] [--steps 10] [methods...]

Each measured step starts from an idle GPU (synchronised before it), so both clocks start together. GPU only.
"""
import argparse
import collections
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
from benchmarks.steps import harness as S  # noqa: E402


class Marks:
    def __init__(self):
        self.active = False
        self.current = []

    def mark(self, name):
        if not self.active or torch.cuda.is_current_stream_capturing():
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.current.append((name, time.perf_counter(), event))


MARKS = Marks()


def wrap(owner, attr, label):
    original = getattr(owner, attr)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        MARKS.mark(f"> {label}")
        out = original(*args, **kwargs)
        MARKS.mark(f"< {label}")
        return out

    setattr(owner, attr, wrapper)


def instrument():
    import cat_fast
    from cat_fast import models
    from cat_fast.objectives import cat, cat_graphs, cat_tasks, gs, gs_first_order

    wrap(models, "capture", "models.capture")
    wrap(models, "first_token_forward", "models.first_token_forward")
    wrap(cat.CAT, "_draw_lambda", "CAT._draw_lambda")
    wrap(cat.CAT, "_draw_partner", "CAT._draw_partner")
    wrap(cat_graphs.CALGraphs, "run", "CALGraphs.run")
    wrap(cat_graphs.CALGraphs, "_replay", "CALGraphs._replay")
    wrap(cat_tasks, "crm_loss", "crm_loss")
    for module in (gs, gs_first_order):  # the exact and the first-order pass
        wrap(module, "gs_cosine_loss", "gs_cosine_loss")
        wrap(module, "masked_mean", "masked_mean")
    wrap(gs.GradientSupervision, "_linear_head_gradient", "GS._linear_head_gradient")
    wrap(torch.Tensor, "backward", "loss.backward")
    wrap(torch.optim.AdamW, "step", "optimizer.step")
    return cat_fast


def timeline(method, size, steps):
    model, optimizer, step = S.build_step(method, size)
    for _ in range(10):  # CAT captures its graphs for each mixing layer on first sight
        step()
    rows = collections.defaultdict(lambda: [0.0, 0.0, 0])
    order = []
    for _ in range(steps):
        torch.cuda.synchronize()
        MARKS.current = []
        MARKS.active = True
        MARKS.mark("step start")
        step()
        MARKS.mark("step end")
        MARKS.active = False
        torch.cuda.synchronize()
        _, h0, e0 = MARKS.current[0]
        seen = collections.Counter()
        for name, host, event in MARKS.current:
            seen[name] += 1
            key = f"{name} #{seen[name]}" if seen[name] > 1 else name
            if key not in rows:
                order.append(key)
            r = rows[key]
            r[0] += (host - h0) * 1e3
            r[1] += e0.elapsed_time(event)
            r[2] += 1
    print(f"\n== {method} {size}: mean over {steps} steps (each from an idle GPU); ms since the step start")
    print(f"   {'mark':40s} {'host':>8s} {'GPU':>8s} {'GPU-host':>9s}")
    for key in order:
        host, gpu, n = rows[key]
        host, gpu = host / n, gpu / n
        print(f"   {key[:40]:40s} {host:8.2f} {gpu:8.2f} {gpu - host:9.2f}{'   <- GPU waits for the host' if gpu - host < 0.05 else ''}")
    del model, optimizer, step
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="*", default=["plain_first_token", "cat", "gs_pooled"])
    parser.add_argument("--size", default="64x256")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("host_timeline.py needs a CUDA device")
    instrument()
    for method in args.methods:
        timeline(method, args.size, args.steps)


if __name__ == "__main__":
    main()
