"""Gradient supervision on the pooled representation of a linear head (docs/METHODS.md §2.3), as a composite of
PyTorch ops: g_i = W[y_j] (the closed-form gradient of the partner's logit), L = Σ_i w_i (1 − cos(g_i, x_j − x_i))
over the rows with a differently-labelled partner, w_i = 1 / count."""
import torch
import torch.nn.functional as F


def partners(pairs, labels):
    """(partner index clamped at 0, the partner's label, whether the row has a counterfactual partner) [B]."""
    partner = pairs.clamp_min(0)
    partner_labels = labels.index_select(0, partner)
    return partner, partner_labels, (pairs >= 0) & (partner_labels != labels)


def weighted_cosine_loss(g, g_hat, weights, weight_sum, eps=1e-8):
    """``Σ_i weights_i (1 − cos(g_i, ĝ_i)) = Σ_i weights_i − weights · cos`` for [B, D] rows, norms clamped below
    at eps, in the dtype of `g` (float32 for 16-bit `g_hat`): one composite op instead of a custom-op call — at
    [B, D] the work is a few microseconds and the host time of the calls is what counts."""
    cos = F.cosine_similarity(g, g_hat.to(g.dtype), dim=1, eps=eps)
    return weight_sum - torch.dot(weights, cos)


def pooled_gs_loss(weight, x, pairs, labels, eps=1e-8):
    """``(L, count, ∂L/∂W)``: g = W[y_j] rounded to x's dtype, the cosine in float32 (float64 for float64 x),
    autograd for ∂L/∂W."""
    acc = torch.promote_types(x.dtype, torch.float32)
    weight = weight.detach().requires_grad_(True)
    partner, partner_labels, valid = partners(pairs, labels)
    count = valid.to(acc).sum()
    rows = valid.to(acc) / count.clamp_min(1)
    with torch.enable_grad():
        g = weight.index_select(0, partner_labels).to(x.dtype).to(acc)
        g_hat = (x.index_select(0, partner) - x).detach()
        loss = weighted_cosine_loss(g, g_hat, rows, rows.sum(), eps)
        (grad_w,) = torch.autograd.grad(loss, weight)
    return loss.detach(), count, grad_w
