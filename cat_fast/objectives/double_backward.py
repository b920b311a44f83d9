"""Double backward through a model's attention, for the objectives that differentiate a gradient (exact GS, CAT +
GS): PyTorch's error for an attention kernel without it mapped to one line that says how to fix it
(`double_backward_error`, used by the Trainer classes), and the check that raises that line before the backward
(`check_double_backward`).
"""
from __future__ import annotations

import torch

__all__ = ["DOUBLE_BACKWARD_HINT", "double_backward_error", "has_missing_double_backward", "check_double_backward"]

DOUBLE_BACKWARD_HINT = (
    "gradient supervision mode='exact' needs a double backward through the model, but its attention kernel has "
    "none (derivative for aten::_scaled_dot_product_*_attention_backward is not implemented): load the model with "
    "attn_implementation=\"eager\", or run under torch.nn.attention.sdpa_kernel(SDPBackend.MATH), "
    "or use mode=\"first_order\""
)


def double_backward_error(exc):
    """Map PyTorch's "derivative for aten::_scaled_dot_product_*_attention_backward is not implemented" to a
    one-line RuntimeError that says how to fix it; None for any other exception."""
    text = str(exc)
    if "derivative for aten::_scaled_dot_product" in text and "not implemented" in text:
        return RuntimeError(DOUBLE_BACKWARD_HINT)
    return None


def has_missing_double_backward(t: torch.Tensor) -> bool:
    """True when the autograd graph of `t` holds a node whose backward is not implemented (PyTorch's
    ``NotImplemented`` node: differentiating `t` again would raise)."""
    fn = t.grad_fn
    if fn is None:
        return False
    stack, seen = [fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "NotImplemented" in node.name():
            return True
        stack.extend(f for f, _ in node.next_functions)
    return False


def check_double_backward(g: torch.Tensor, model) -> None:
    """Raise the one-line `DOUBLE_BACKWARD_HINT` error when `g` (built with create_graph through `model`'s
    attention) cannot be differentiated. Eager attention is plain matmuls and softmax, always twice
    differentiable: the graph walk (milliseconds of host time per step) runs only for other implementations."""
    if getattr(model.config, "_attn_implementation", None) == "eager":
        return
    if has_missing_double_backward(g):
        raise RuntimeError(DOUBLE_BACKWARD_HINT)
