"""Where and at what sizes the step benchmarks run: the device, BERT config, sizes, mixing layers, step counts.

On a CUDA machine: BERT-base (`BertConfig()` defaults, num_labels=2), B x T = 8x128, 32x128, 64x256 (and 32x512
for the GS rows), >= 5 warm-up steps then <= 25 timed steps (CAT_FAST_BENCH_STEP_WARMUP,
CAT_FAST_BENCH_STEP_STEPS; defaults 5 and 20). Without one, CAT_FAST_BENCH_STEP_CPU=1 runs the same code on the
CPU with a tiny BERT (a smoke test of the benchmark code, no meaningful numbers); otherwise the cases skip (`SKIP`),
and the builders of `harness` still make the tiny CPU model (tests/benchmarks/ runs one step of every method).
"""
import gc
import os

import torch

from benchmarks import _harness as H

CAT_LAYERS = [8, 9, 10]
NAIVE_LAYER = 9
# CAT's hyper-parameters (docs/METHODS.md §1), shared by `cat_fast.CAT` and the hand-written naive step.
ADV_STEPS = 3
ALPHA = BETA = 0.3
GAMMA, ETA, ADV_LR = 10.0, 20.0, 2e-2

CPU_SMOKE = os.environ.get("CAT_FAST_BENCH_STEP_CPU", "0") == "1" and not H.HAS_CUDA


def setting():
    """(device, config kwargs, sizes, GS long-sequence size, mixing layers, naive layer, warm-up, timed steps); the
    tiny CPU model wherever there is no CUDA device (the smoke run's, and the builders' tests')."""
    if not H.HAS_CUDA:
        config = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                      vocab_size=2000, max_position_embeddings=64)
        return "cpu", config, ("2x16", "4x32"), "2x64", [2, 3], 3, 1, 2
    warmup = max(1, H.env_int("CAT_FAST_BENCH_STEP_WARMUP", 5))
    steps = min(25, max(1, H.env_int("CAT_FAST_BENCH_STEP_STEPS", 20)))
    return "cuda", {}, ("8x128", "32x128", "64x256"), "32x512", CAT_LAYERS, NAIVE_LAYER, warmup, steps


DEVICE, CONFIG, SIZES, LONG_SIZE, LAYERS, NAIVE_M, WARMUP, STEPS = setting()
SKIP = None if (H.HAS_CUDA or CPU_SMOKE) else H.NO_CUDA_REASON + " (CAT_FAST_BENCH_STEP_CPU=1: tiny CPU smoke run)"


def autocast():
    return torch.autocast(DEVICE, dtype=torch.bfloat16)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def free():
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
