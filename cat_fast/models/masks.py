"""What a CUDA-graph capture of a Hugging Face model needs around it: `graph_capture(graph, pool)`.

Autocast's weight cache. A model whose ``forward`` is wrapped in ``torch.autocast`` (accelerate does so for the
Trainer under ``bf16``/``fp16``) turns the cache back on inside the capture, even where the caller captures under
``cache_enabled=False``. Inside the capture the cache then hands out the bf16 copies of the weights that the eager
clean forward made before it: the graph records reads of those tensors, which are freed when the step's autocast
ends, and every replay reads whatever memory took their place (CAT's replayed CAL steps gave NaN λ under the
Trainer with bf16, found on an H100). The other way round, copies made during the capture (their kernels not run
yet) would be handed to eager code after it. `graph_capture` therefore empties the cache before and after.

Attention masks.

Hugging Face's eager-attention mask (`transformers.masking_utils.eager_mask`, transformers 5) turns the boolean mask
into an additive one with ``torch.where(mask, torch.tensor(0.0, device=...), min)``: the ``torch.tensor`` copies a
host scalar to the GPU, which CUDA-graph capture refuses ("Cannot copy between CPU and CUDA tensors during CUDA graph
capture"). Every model run with ``attn_implementation="eager"`` (CAT with ``gs_weight > 0`` needs it for the double
backward) therefore failed capture. `capture_safe_masks()` swaps, for the duration of a capture only, the registered
eager mask function for one that computes the same tensor (the same values, dtype and shape; `tests/models`
compares them) from device operations alone. Where transformers has no such registry (older versions, models that
build their own masks) it changes nothing.
"""
import contextlib
import inspect

import torch

from ..layers import casts


def mask_registry():
    """(transformers' ``masking_utils``, its mask-function mapping by attention implementation), or (None, None)
    where this transformers has no such registry."""
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None, None
    functions = getattr(masking_utils, "ALL_MASK_ATTENTION_FUNCTIONS", None)
    mapping = getattr(functions, "_global_mapping", None)
    if not isinstance(mapping, dict) or "eager" not in mapping or not hasattr(masking_utils, "sdpa_mask"):
        return None, None
    return masking_utils, mapping


def capture_safe_eager_mask(original, sdpa_mask):
    """An eager mask function with `original`'s signature that builds its additive mask on the device."""
    signature = inspect.signature(original)

    def eager_mask(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        extra = arguments.pop("kwargs", {})
        dtype = arguments.pop("dtype")
        extra.pop("allow_is_causal_skip", None)
        mask = sdpa_mask(**arguments, allow_is_causal_skip=False, **extra)
        if mask is None:  # a bidirectional mask without padding may be skipped, as in the original
            return None
        return torch.full(mask.shape, torch.finfo(dtype).min, dtype=dtype, device=mask.device).masked_fill_(mask, 0.0)

    eager_mask.__wrapped__ = original
    return eager_mask


@contextlib.contextmanager
def graph_capture(graph, pool=None):
    """``torch.cuda.graph(graph, pool=pool)`` with autocast's weight cache and the fast layers' shared 16-bit weights
    (`layers.casts`) emptied before and after, and eager attention masks built on the device (module docstring)."""
    torch.clear_autocast_cache()
    casts.clear()
    try:
        with capture_safe_masks(), torch.cuda.graph(graph, pool=pool):
            yield graph
    finally:
        torch.clear_autocast_cache()
        casts.clear()


@contextlib.contextmanager
def capture_safe_masks():
    """While inside: models with eager attention build their masks without a host-to-device copy (module docstring)."""
    masking_utils, mapping = mask_registry()
    if mapping is None:
        yield
        return
    original = mapping["eager"]
    try:
        params = inspect.signature(original).parameters
    except (TypeError, ValueError):
        params = {}
    if "dtype" not in params or getattr(original, "__wrapped__", None) is not None:
        yield  # an unknown or already replaced function: leave it alone
        return
    mapping["eager"] = capture_safe_eager_mask(original, masking_utils.sdpa_mask)
    try:
        yield
    finally:
        mapping["eager"] = original
