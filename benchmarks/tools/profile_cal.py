"""Where the GPU time of CAT's counterfactual passes goes: one CAL step (forward of layers m+1..L and the
input-only backward) and the final counterfactual forward, at one mixing layer, on the step benchmark's model
and batch.

    python benchmarks/tools/profile_cal.py [--size 64x256] [--layer 9] [--reps 5]

Prints the GPU time of one replay of each captured CUDA graph (CUDA events, host ahead), then the same passes
run eagerly under torch.profiler (kernels summed by name and by kind), then one layer's forward + input-only
backward per implementation (the model's own, `cat_fast.layers.resumed` fused and PyTorch-only, and the model's
own at 3/4 of the tokens). GPU only.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
from benchmarks import _harness as H  # noqa: E402
from benchmarks.steps import harness as S  # noqa: E402
from benchmarks.tools.profile_step import kernel_times  # noqa: E402


def graphs_of(cat, layer):
    for (_, key), entry in cat.graphs.cache.entries.items():  # key[0]: the mixing layer (`CALGraphs._signature`)
        if entry is not None and key[0] == layer:
            return entry
    return None


def gpu_ms(fn, reps=20, spin_cycles=40_000_000):
    """Median GPU milliseconds of `fn()`: a ~20 ms spin kernel queued first keeps the host ahead of the GPU."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(spin_cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def profile_kernels(fn, reps, label):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    by_name, count, by_kind, _ = kernel_times(prof, reps)
    total = sum(by_kind.values())
    print(f"\n== {label}: kernels {total / 1e3:.3f} ms per pass, {sum(count.values()):.0f} kernels")
    print("   by kind: " + ", ".join(f"{k} {v / 1e3:.3f}" for k, v in by_kind.most_common()))
    for name, us in by_name.most_common(30):
        print(f"   {us / 1e3:7.3f} ms  x{count[name]:4.0f}  {name[:140]}")


def layer_variants(model, size, reps):
    """GPU time of one layer's forward + input-only backward (the CAL pass's work per layer), per variant."""
    from cat_fast import models

    batch_size, tokens = H.dims(size)
    batch, _ = S.make_batch(batch_size, tokens, model.config.vocab_size)
    mask = models.inputs._padding_mask_4d(batch["attention_mask"])
    layer = models.structure(model).layer_modules[10]
    x0 = torch.randn(batch_size, tokens, model.config.hidden_size, device="cuda")

    def run(fn, train):
        def body():
            layer.train(train)
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                x = x0.detach().requires_grad_(True)
                y = fn(x)
                y = y[0] if isinstance(y, tuple) else y
                torch.autograd.grad(y.float().square().sum(), x)
        return body

    from cat_fast.layers import resumed as resumed_layer

    short = tokens * 3 // 4
    mask_short = mask[:, :, :short, :short]
    variants = {
        "hf train": run(lambda x: layer(x, mask), True),
        "resumed_layer train": run(lambda x: resumed_layer.forward(layer, (x, mask), {}), True),
        "resumed_layer composed train": run(lambda x: resumed_layer._composed(layer, x, mask, torch.bfloat16), True),
        "hf train, 3/4 of the tokens": run(lambda x: layer(x[:, :short].contiguous(), mask_short), True),
    }
    for name, body in variants.items():
        print(f"layer fwd + input-only bwd [{size}], {name}: {gpu_ms(body):.3f} ms GPU")
    # agreement under bf16 autocast, train mode, same generator state
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        layer.train(True)
        x = x0.detach().requires_grad_(True)
        g = torch.randn_like(x0)
        state = torch.cuda.get_rng_state()
        y1 = layer(x, mask)
        y1 = y1[0] if isinstance(y1, tuple) else y1
        (g1,) = torch.autograd.grad(y1, x, g)
        torch.cuda.set_rng_state(state)
        y2 = resumed_layer.forward(layer, (x, mask), {})
        (g2,) = torch.autograd.grad(y2, x, g)
    print(f"bf16 autocast, train: output max |diff| {(y1 - y2).abs().max().item():.3e} (max |y| "
          f"{y1.abs().max().item():.2f}), input grad max |diff| {(g1 - g2).abs().max().item():.3e} (max |g| "
          f"{g1.abs().max().item():.3e})")
    profile_kernels(variants["hf train"], reps, f"one layer, hf train, {size}")
    profile_kernels(variants["resumed_layer train"], reps, f"one layer, resumed_layer train, {size}")
    layer.train(True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="64x256")
    parser.add_argument("--layer", type=int, default=9)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_cal.py needs a CUDA device")
    from cat_fast import models

    model, optimizer, step = S.build_step("cat", args.size, layers=[args.layer])
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    cat = step.objective
    graphs = graphs_of(cat, args.layer)
    if graphs is not None:
        for name in ("cal", "final"):
            g = graphs.graphs[name]
            ms = gpu_ms(g.replay)
            print(f"graph replay {name} (m={args.layer}, {args.size}): {ms:.3f} ms GPU")

    batch_size, tokens = H.dims(args.size)
    batch, _ = S.make_batch(batch_size, tokens, model.config.vocab_size)
    with S.autocast():
        cap = models.capture(model, batch, args.layer, first_token=True)
    h = cap.hidden.detach()
    lam = cat._draw_lambda(batch_size, h.device, torch.float32)
    partner = cat._draw_partner(batch_size, h.device)
    targets = batch["labels"]

    def cal_step():
        with torch.enable_grad(), torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            lam_var = lam.detach().requires_grad_(True)
            cf = cat.counterfactual_logits(cap, h, lam_var, partner, cap.padding_mask, None)
            objective = cat.cal_objective_per_sample(cf, targets).sum()
            torch.autograd.grad(objective, lam_var)

    def final_forward():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            cat.counterfactual_logits(cap, h, lam, partner, cap.padding_mask, None)

    print(f"eager CAL step GPU time: {gpu_ms(cal_step):.3f} ms; eager final forward: {gpu_ms(final_forward):.3f} ms")
    profile_kernels(cal_step, args.reps, f"eager CAL step, m={args.layer}, {args.size}")
    profile_kernels(final_forward, args.reps, f"eager final forward, m={args.layer}, {args.size}")
    layer_variants(model, args.size, args.reps)


if __name__ == "__main__":
    main()
