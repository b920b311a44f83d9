"""The `measure()` closures of the step cases (`benchmarks/_harness.record` runs them): one method at one size, and
the host-sync check of the CAT step.

A step case: the method's step (`harness.make_step`) timed by `timing.time_steps`; for every method but plain, a
plain SDPA step on its own model built beside it and the two timed interleaved (`timing.time_paired`:
``paired_ratio`` = median method / median plain of that pair); CAT's steps also per drawn mixing layer
(``step_by_layer``, ``paired_by_layer``: {m: [median ms, calls]}) and their mean over the layers
(``paired_layer_ratio``: the expected cost of a step, as the FLOP count's mean m). The compilation of the compiled
rows (``compile_s``) and the graph capture of `cat_captured` (``capture_s``) are timed apart. Peak memory:
torch.cuda.max_memory_allocated over the timed steps (weights, grads and AdamW state included). FLOPs from the
config (`flops.py`).
"""
import time

import torch
import torch.nn.functional as F

from benchmarks import _harness as H
from benchmarks.steps import harness as S
from benchmarks.steps.flops import flop_fields
from benchmarks.steps.setting import DEVICE, LAYERS, NAIVE_M, STEPS, WARMUP, autocast, free, sync
from benchmarks.steps.timing import layer_mean, time_paired, time_steps


def _build(method, attn, batch, pairs):
    model = S.make_model(attn)
    optimizer = S.make_optimizer(model)
    return model, optimizer, S.make_step(method, model, optimizer, batch, pairs)


def _seconds(fn):
    """Seconds of one call of `fn`, synchronised before and after."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _layer_fields(prefix, per_layer, plain_ms=None):
    """``{prefix}_by_layer`` and the layer mean (with its ratio to `plain_ms`) of a CAT step's per-layer medians."""
    if per_layer is None:
        return {}
    out = {f"{prefix}_by_layer": {str(m): v for m, v in per_layer.items()}}
    mean = layer_mean(per_layer)
    if mean is not None:
        out[f"{prefix}_layer_mean_ms"] = mean
        if plain_ms is not None:
            out[f"{prefix}_layer_ratio"] = mean / plain_ms
    return out


def _paired_fields(step, batch, pairs):
    """The paired timing of `step` against a plain SDPA step built beside it."""
    plain_model, plain_opt, plain_step = _build("plain", "sdpa", batch, pairs)
    paired_ms, plain_ms, paired_layers = time_paired(step, plain_step, WARMUP, STEPS)
    del plain_model, plain_opt, plain_step
    return dict(paired_step_ms=paired_ms, paired_plain_ms=plain_ms, paired_ratio=paired_ms / plain_ms,
                **_layer_fields("paired", paired_layers, plain_ms))


def _time_method(method, extra, batch, pairs):
    """(model, step, time_steps' result) of `method`, the compilation or graph capture timed apart into `extra`;
    a pooled GS step whose double backward SDPA refuses is measured again with eager attention."""
    model, optimizer, step = _build(method, extra["attn"], batch, pairs)
    if method in S.COMPILED_METHODS:  # the compilation (the warm-up then runs compiled steps)
        extra["compile_s"] = _seconds(step)
    if hasattr(step, "prime"):  # cat_captured: its graphs, captured before the warm-up
        extra["capture_s"] = _seconds(step.prime)
    try:
        return model, step, time_steps(step, WARMUP, STEPS)
    except RuntimeError as error:
        if not method.startswith("gs_pooled") or "double backward" not in str(error):
            raise
        extra["note"] = f"sdpa refused ({str(error)[:120]}); eager attention"
    model = optimizer = step = None
    free()
    extra["attn"] = "eager"
    model, optimizer, step = _build(method, "eager", batch, pairs)
    return model, step, time_steps(step, WARMUP, STEPS)


def measure_step(method, size):
    batch_size, tokens = H.dims(size)

    def measure():
        free()
        attn = S.SPECS[method].attn
        extra = {"method": method, "size": size, "batch": batch_size, "tokens_per_sample": tokens,
                 "tokens": batch_size * tokens, "attn": attn, "warmup_steps": WARMUP, "timed_steps": STEPS,
                 "device": DEVICE}
        model = step = None
        try:
            batch, pairs = S.make_batch(batch_size, tokens, S.make_config(attn).vocab_size)
            model, step, (median_ms, min_ms, peak, per_layer) = _time_method(method, extra, batch, pairs)
            config = model.config
            extra["attn"] = getattr(config, "_attn_implementation", extra["attn"])
            if method != "plain":
                extra.update(_paired_fields(step, batch, pairs))
            extra.update(step_ms=median_ms, step_min_ms=min_ms, peak_mib=peak,
                         tokens_per_s=batch_size * tokens / (median_ms * 1e-3))
            if hasattr(step, "captured"):  # the *_captured rows: graphs captured (0: every step ran eagerly)
                extra["captured_graphs"] = step.captured.num_graphs
            extra.update(_layer_fields("step", per_layer))
            m = NAIVE_M if method == "naive_cat" else sum(LAYERS) / len(LAYERS)
            extra.update(flop_fields(config, batch_size, tokens, method, m, median_ms * 1e-3))
            return median_ms * 1e-3, extra
        finally:
            model = step = None
            free()

    return measure


# ----------------------------------------------------------------------------- host-sync check


def _sync_check(fn):
    """None if fn() ran without a host synchronisation under set_sync_debug_mode("error"), else the message."""
    if DEVICE != "cuda":
        fn()
        return "not checked (no CUDA)"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return None
    except Exception as error:  # the sync itself raises a RuntimeError
        return H.describe(error)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def _forward_backward(model, objective=None):
    """A function of a batch returning a closure of one forward + backward: the plain step's, or `objective`'s."""
    def of(inputs):
        def run():
            with autocast():
                if objective is None:
                    logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
                    loss = F.cross_entropy(logits.float(), inputs["labels"])
                else:
                    loss, _ = objective(inputs)
            loss.backward()
        return run
    return of


def measure_sync(size):
    """One CAT step (and, for attribution, one plain step) under torch.cuda.set_sync_debug_mode("error"), on a
    padded batch and on one without attention_mask: whether each raised."""
    batch_size, tokens = H.dims(size)

    def measure():
        free()
        model = S.make_model("sdpa")
        optimizer = S.make_optimizer(model)
        batch, pairs = S.make_batch(batch_size, tokens, model.config.vocab_size)
        plain_step = S.make_step("plain", model, optimizer, batch, pairs)
        cat_step = S.make_step("cat", model, optimizer, batch, pairs)
        for _ in range(2):  # first calls: lazy initialisation, Triton JIT, cuBLAS handles
            plain_step()
            cat_step()
        sync()
        plain_fb, cat_fb = _forward_backward(model), _forward_backward(model, cat_step.objective)
        # Hugging Face's SDPA mask creation itself syncs on a padded batch (`padding_mask.all()` in
        # transformers.masking_utils), so CAT is also checked on a batch without attention_mask (no padding).
        no_mask = {k: v for k, v in batch.items() if k != "attention_mask"}
        for inputs in (batch, no_mask):  # capture this CAT's CUDA graphs (capturing synchronises) before checking
            cat_fb(inputs)()
            optimizer.zero_grad(set_to_none=True)
        sync()
        extra = {"size": size, "device": DEVICE}
        for name, fn in (("sync_plain", plain_fb(batch)), ("sync_cat", cat_fb(batch)),
                         ("sync_plain_nomask", plain_fb(no_mask)), ("sync_cat_nomask", cat_fb(no_mask))):
            extra[name] = _sync_check(fn)
            optimizer.zero_grad(set_to_none=True)
            extra[name + "_raised"] = None if DEVICE != "cuda" else extra[name] is not None
        model = optimizer = cat_step = plain_step = plain_fb = cat_fb = None  # the closures hold them
        free()
        return 0.0, extra

    return measure
