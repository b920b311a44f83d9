"""gs_cosine_loss: the gradient-supervision loss 1 - cos(g_i, g_hat_i) per row (docs/METHODS.md §2), differentiable to any order.

Composed of two kernel ops whose derivatives are again made of those ops (and plain torch ops):
`gs_row_dots(x, y) -> [N, 3]` = (x.y, x.x, y.y) per row and `gs_row_combine(x, y, coef) -> (u, v)` with
u = c0 x + c1 y, v = c2 x + c3 y per row. So double backward (needed when g is an input gradient
built with create_graph=True) runs the same fused kernels.
"""
import torch

from ..kernels import reference
from . import registry, validate
from .backend import select

registry.define({
    "gs_row_dots": "(Tensor x, Tensor y) -> Tensor",
    "gs_row_combine": "(Tensor x, Tensor y, Tensor coef) -> (Tensor, Tensor)",
}, triton="gs_cosine_loss")

REDUCTIONS = ("mean", "sum", "none")
SCALARS = {"eps": dict(low=0.0, open_low=True)}  # the norms' lower clamp


def _zeros_if_none(grad, like):
    return torch.zeros_like(like) if grad is None else grad.contiguous()


def _row_dots_backward(family):
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        coef = torch.stack((2 * grad[:, 1], grad[:, 0], grad[:, 0], 2 * grad[:, 2]), 1).contiguous()
        grad_x, grad_y = family.gs_row_combine(x, y, coef)
        return grad_x, grad_y

    return backward


def _row_combine_backward(family):
    def backward(ctx, grad_u, grad_v):
        x, y, coef = ctx.saved_tensors
        grad_u, grad_v = _zeros_if_none(grad_u, x), _zeros_if_none(grad_v, x)
        swapped = coef[:, [0, 2, 1, 3]].contiguous()
        grad_x, grad_y = family.gs_row_combine(grad_u, grad_v, swapped)
        acc = coef.dtype
        xa, ya, ua, va = x.to(acc), y.to(acc), grad_u.to(acc), grad_v.to(acc)
        grad_coef = torch.stack(((ua * xa).sum(1), (ua * ya).sum(1), (va * xa).sum(1), (va * ya).sum(1)), 1)
        return grad_x, grad_y, grad_coef

    return backward


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _save_inputs_unmaterialized(ctx, inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.set_materialize_grads(False)  # an unused output (u or v) needs no zero-filled gradient


registry.register(
    "gs_row_dots",
    lambda x, y: x.new_empty((x.shape[0], 3), dtype=registry.acc_dtype(x.dtype)),
    _row_dots_backward,
    _save_inputs,
)
registry.register(
    "gs_row_combine",
    lambda x, y, coef: (torch.empty_like(x), torch.empty_like(x)),
    _row_combine_backward,
    _save_inputs_unmaterialized,
)


def gs_cosine_loss(g, g_hat, reduction="mean", eps=1e-8):
    """Per row i (dim 0; all further dims flattened): `1 - cos(g_i, g_hat_i)`, norms clamped below at eps; reduced by mean/sum/none.

    eps: a finite number > 0."""
    validate.tensor("g", g)
    if g.dim() < 1:
        raise ValueError("g: expected at least 1 dimension (rows), got a 0-d tensor")
    validate.nonempty_batch("g", g)
    validate.tensor("g_hat", g_hat)
    validate.shape("g_hat", g_hat, g.shape, "like g")
    if g_hat.dtype != g.dtype:
        raise TypeError(f"g_hat: expected dtype {g.dtype} (the dtype of g), got {g_hat.dtype}")
    validate.same_device(g=g, g_hat=g_hat)
    validate.choice("reduction", reduction, REDUCTIONS)
    (eps,) = validate.scalars(SCALARS, eps=eps)
    backend = select("gs_cosine_loss", g.device)
    if backend == "reference":
        return reference.gs_cosine_loss(g, g_hat, reduction, eps)
    x = g.reshape(g.shape[0], -1).contiguous()
    y = g_hat.reshape(g.shape[0], -1).contiguous()
    dots = registry.kernels(backend).gs_row_dots(x, y)
    norms = dots[:, 1].clamp_min(eps * eps).sqrt() * dots[:, 2].clamp_min(eps * eps).sqrt()
    losses = 1 - dots[:, 0] / norms
    if reduction == "mean":
        return losses.mean()
    if reduction == "sum":
        return losses.sum()
    return losses
