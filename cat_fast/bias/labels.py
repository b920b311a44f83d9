"""Label-set conversions of bias log-probabilities (docs/METHODS.md §4).

``expand_two_class(b2, entailment_index)`` turns a 2-class bias (entailment vs non-entailment, Clark et al.'s MNLI
bias model) into one over the main task's labels: entailment keeps ``b_ent``, and the non-entailment mass is split
evenly over the other classes, each ``b_not − log(C − 1)`` (``− log 2`` for 3-way NLI). With the library's NLI order
(entailment, neutral, contradiction), ``entailment_index=0`` gives ``[b_ent, b_not − log 2, b_not − log 2]``; Clark's
order (contradiction, entailment, neutral) is ``entailment_index=1``. Rows stay normalised.
"""
from __future__ import annotations

import math

import torch

__all__ = ["expand_two_class"]


def expand_two_class(log_probs_2: torch.Tensor, entailment_index: int, num_classes: int = 3,
                     entailment_column: int = 0) -> torch.Tensor:
    """``[N, 2]`` → ``[N, num_classes]`` log-probabilities (same dtype and device).

    ``log_probs_2``: column ``entailment_column`` (0 by default: ``[b_ent, b_not]``; Clark's released files have
    entailment in column 1) is entailment, the other column non-entailment. ``entailment_index``: the position of
    entailment in the main task's label order, e.g. ``label_names.index("entailment")``.
    """
    if not isinstance(log_probs_2, torch.Tensor) or log_probs_2.dim() != 2 or log_probs_2.shape[1] != 2:
        shape = tuple(log_probs_2.shape) if isinstance(log_probs_2, torch.Tensor) else type(log_probs_2).__name__
        raise ValueError(f"expand_two_class: log_probs_2 is {shape}; expected a tensor [N, 2] (entailment, "
                         f"non-entailment log-probabilities)")
    if not (isinstance(num_classes, int) and num_classes >= 2):
        raise ValueError(f"expand_two_class: num_classes={num_classes!r}; expected an integer >= 2")
    if not (isinstance(entailment_index, int) and 0 <= entailment_index < num_classes):
        raise ValueError(f"expand_two_class: entailment_index={entailment_index!r}; expected an integer in "
                         f"0..{num_classes - 1} (entailment's position in the main task's labels)")
    if entailment_column not in (0, 1):
        raise ValueError(f"expand_two_class: entailment_column={entailment_column!r}; expected 0 or 1")
    b_ent = log_probs_2[:, entailment_column]
    b_not = log_probs_2[:, 1 - entailment_column] - math.log(num_classes - 1)
    cols = [b_ent if c == entailment_index else b_not for c in range(num_classes)]
    return torch.stack(cols, 1)
