"""The ten per-sample training characteristics of CLP (docs/METHODS.md §5.1) in plain PyTorch: the oracle of the
fused op. Columns, per row i with label y (p = softmax(z), W = class_weights, f = features_i):

0 ``-log p_y``; 1 ``p_y - max_{c≠y} p_c``; 2 ``‖1 - p‖₂`` (1 the all-ones vector); 3 ``cos(f, W_y)`` with each norm
clamped below at eps; 4 ``Σ_c p_c log p_c``; 5 ``prior[y]``; 6 ``mean_loss[y]``; 7 ``‖W_y‖₂``; 8 col 0 − col 6;
9 col 1 − ``mean_margin[y]``. `class_stats` [C, 3] holds (prior, mean_loss, mean_margin) per class (no gradient).
The margin's other class is the first index of the largest logit among c ≠ y. Rows whose label equals
`ignore_index` are zero rows with zero gradients. Everything is computed in the accumulation dtype of `logits`.
"""
import torch
import torch.nn.functional as F

from ..dtypes import upcast


def sample_characteristics(logits, labels, features, class_weights, class_stats, eps=1e-8, ignore_index=-100):
    keep = labels != ignore_index
    y = torch.where(keep, labels, torch.zeros_like(labels)).long()
    z, f, weights = upcast(logits), upcast(features), upcast(class_weights)
    stats = class_stats.detach().to(z.dtype)
    log_p = F.log_softmax(z, -1)
    p = log_p.exp()
    loss = -log_p.gather(1, y[:, None]).squeeze(1)
    label_mask = F.one_hot(y, z.shape[1]).bool()
    other = z.masked_fill(label_mask, float("-inf")).argmax(-1, keepdim=True)  # first index of the largest other
    margin = p.gather(1, y[:, None]).squeeze(1) - p.gather(1, other).squeeze(1)
    gap_norm = torch.linalg.vector_norm(1 - p, dim=-1)
    w = weights[y]
    w_norm = torch.linalg.vector_norm(w, dim=-1)
    f_norm = torch.linalg.vector_norm(f, dim=-1)
    cosine = (f * w).sum(-1) / (f_norm.clamp_min(eps) * w_norm.clamp_min(eps))
    neg_entropy = (p * log_p).sum(-1)
    prior, mean_loss, mean_margin = stats[y].unbind(-1)
    columns = (loss, margin, gap_norm, cosine, neg_entropy, prior, mean_loss, w_norm, loss - mean_loss,
               margin - mean_margin)
    out = torch.stack(columns, -1)
    return torch.where(keep[:, None], out, torch.zeros_like(out))
