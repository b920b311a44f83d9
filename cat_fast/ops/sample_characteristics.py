"""sample_characteristics: the ten per-sample training characteristics that CLP's perturbation network reads
(docs/METHODS.md §5.1), in one fused kernel per direction (docs/KERNELS.md "sample_characteristics").

    chars = sample_characteristics(logits, labels, features, head.weight, class_stats)   # [B, 10]

`features` is the classifier head's input [B, H], `class_weights` its weight [C, H]; `class_stats` [C, 3] holds,
per class, the columns of `CLASS_STATS`: its prior, its mean loss and its mean margin over the last epoch.
"""
import torch

from ..kernels import reference
from . import registry, validate
from .backend import select

__all__ = ["sample_characteristics", "CHARACTERISTICS", "CLASS_STATS"]

CHARACTERISTICS = ("loss", "margin", "gap_norm", "cosine", "neg_entropy", "prior", "class_mean_loss",
                   "weight_norm", "relative_loss", "relative_margin")
CLASS_STATS = ("prior", "mean_loss", "mean_margin")
SCALARS = {"eps": dict(low=0.0, open_low=True), "ignore_index": validate.INT}  # eps: the cosine's norm clamp

registry.define({
    "sample_characteristics_forward": "(Tensor logits, Tensor labels, Tensor features, Tensor class_weights, "
                                      "Tensor class_stats, float eps, int ignore_index=-100) -> Tensor",
    "sample_characteristics_backward": "(Tensor grad, Tensor logits, Tensor labels, Tensor features, "
                                       "Tensor class_weights, float eps, int ignore_index=-100) "
                                       "-> (Tensor, Tensor, Tensor)",
}, triton="sample_characteristics")


def _backward(family):
    def backward(ctx, grad):
        logits, labels, features, class_weights = ctx.saved_tensors
        grad_logits, grad_features, grad_weights = family.sample_characteristics_backward(
            grad.contiguous(), logits, labels, features, class_weights, ctx.eps, ctx.ignore_index)
        return grad_logits, None, grad_features, grad_weights, None, None, None

    return backward


def _setup(ctx, inputs, output):
    logits, labels, features, class_weights, _, ctx.eps, ctx.ignore_index = inputs
    ctx.save_for_backward(logits, labels, features, class_weights)


def _fake_forward(logits, labels, features, class_weights, class_stats, eps, ignore_index=-100):
    return logits.new_empty((logits.shape[0], len(CHARACTERISTICS)), dtype=registry.acc_dtype(logits.dtype))


def _fake_backward(grad, logits, labels, features, class_weights, eps, ignore_index=-100):
    return torch.empty_like(logits), torch.empty_like(features), torch.empty_like(class_weights)


registry.register("sample_characteristics_forward", _fake_forward, _backward, _setup)
registry.register("sample_characteristics_backward", _fake_backward,
                  registry.not_twice_differentiable("sample_characteristics"))


def _check(logits, labels, features, class_weights, class_stats, eps, ignore_index):
    eps, ignore_index = validate.scalars(SCALARS, eps=eps, ignore_index=ignore_index)
    validate.tensor("logits", logits, ndims=(2,))
    if logits.shape[1] < 2:
        raise ValueError(f"logits: expected at least two classes (C >= 2: the margin compares the label's "
                         f"probability with another class's), got shape {tuple(logits.shape)}")
    validate.classes("logits", logits, labels, ignore_index)
    validate.tensor("features", features, ndims=(2,))
    validate.size("features", features, 0, logits.shape[0], "one row per row of logits")
    if features.shape[1] < 1:
        raise ValueError(f"features: expected at least one column (H >= 1), got shape {tuple(features.shape)}")
    validate.tensor("class_weights", class_weights, ndims=(2,))
    validate.shape("class_weights", class_weights, (logits.shape[1], features.shape[1]),
                   "[C, H]: one row per class of logits, one column per column of features")
    validate.tensor("class_stats", class_stats, ndims=(2,))
    validate.shape("class_stats", class_stats, (logits.shape[1], len(CLASS_STATS)),
                   "[C, 3]: prior, mean loss, mean margin per class")
    for name, value in (("features", features), ("class_weights", class_weights)):
        validate.dtype_like(name, value, "logits", logits)
    validate.same_device(logits=logits, features=features, class_weights=class_weights, class_stats=class_stats)
    return labels.long(), eps, ignore_index


def sample_characteristics(logits, labels, features, class_weights, class_stats, eps=1e-8, ignore_index=-100):
    """The [B, 10] characteristics of each row (columns named by `CHARACTERISTICS`), in the accumulation dtype of
    `logits` (float32; float64 for float64 logits). With p = softmax(logits_i), y = labels_i, W = class_weights:

    0 ``-log p_y``; 1 ``p_y - max_{c≠y} p_c``; 2 ``‖1 - p‖₂`` (1 the all-ones vector, as the paper's code has it);
    3 ``cos(features_i, W_y)``, each norm clamped below at `eps` (like `F.cosine_similarity`); 4 ``Σ_c p_c log p_c``;
    5 ``class_stats[y, 0]`` (prior); 6 ``class_stats[y, 1]`` (mean loss); 7 ``‖W_y‖₂``; 8 col 0 − col 6;
    9 col 1 − ``class_stats[y, 2]`` (mean margin).

    logits [B, C] float, C >= 2; labels int [B] in [0, C) or `ignore_index`; features [B, H] and class_weights
    [C, H] of the dtype of logits; class_stats [C, 3] float (no gradient). Differentiable (first order) w.r.t.
    logits, features and class_weights. Rows whose label equals `ignore_index` are rows of zeros with zero
    gradients: finite, so a network fed with them stays finite (leave such rows out of its statistics)."""
    labels, eps, ignore_index = _check(logits, labels, features, class_weights, class_stats, eps, ignore_index)
    backend = select("sample_characteristics", logits.device)
    if backend == "reference":
        return reference.sample_characteristics(logits, labels, features, class_weights, class_stats, eps,
                                                ignore_index)
    acc = registry.acc_dtype(logits.dtype)
    return registry.kernels(backend).sample_characteristics_forward(
        logits.contiguous(), labels.contiguous(), features.contiguous(), class_weights.contiguous(),
        class_stats.detach().to(acc).contiguous(), eps, ignore_index)
