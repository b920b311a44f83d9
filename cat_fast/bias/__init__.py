"""Bias-only models and their predictions, for the bias-model losses (docs/METHODS.md §4: reweighting, product of
experts, learned-mixin, confidence regularisation).

Each bias model gives per-example log-probabilities ``b`` ``[N, C]`` over the main task's labels, stored per split
and keyed by example id (``CadData.ids``):

* :class:`OverlapBias` — hand-crafted word-overlap features (:func:`overlap_features`, Clark et al. 2019) and a
  class-balanced :class:`LogisticRegression`, fitted on the training split;
* :class:`ColumnBias` — a classifier trained by cat_fast on one column (hypothesis-only NLI), scored on that column;
* :class:`FeatureBias` — p(y | named columns of the data): the exact smoothed conditional of categorical columns,
  or a logistic regression (:func:`read_feature_columns`, :func:`typed_columns` read and check the columns);
* :class:`WeakLearner` — an unnamed bias: a small classifier fine-tuned briefly on a small subset;
* :func:`cross_fit` — every example's prediction from a model fitted without its fold (groups kept whole);
* :func:`save_bias` / :func:`load_bias` — the file format (JSON Lines, checked, aligned to ids and label order);
* :func:`expand_two_class` — Clark's 2-class (entailment vs not) bias to the main task's labels.

Typical use::

    from cat_fast import bias, data
    train, dev = data.load_builtin("nli"), data.load_builtin("nli", "dev")
    ob = bias.OverlapBias().fit(train)
    for name, d in (("train", train), ("dev", dev)):
        bias.save_bias(f"bias/{name}.jsonl", d.ids, ob.log_probs(d), d.label_names, ob.meta(), data=d)
    b = bias.load_bias("bias/train.jsonl", label_names=train.label_names, data=train)   # [N, 3], fingerprint checked
"""
from . import column, crossfit, feature_columns, feature_model, features, files, labels, logistic, overlap, weak_learner
from .column import *  # noqa: F401,F403  (the public names are listed in each module's __all__)
from .crossfit import *  # noqa: F401,F403
from .feature_columns import *  # noqa: F401,F403
from .feature_model import *  # noqa: F401,F403
from .features import *  # noqa: F401,F403
from .files import *  # noqa: F401,F403
from .labels import *  # noqa: F401,F403
from .logistic import *  # noqa: F401,F403
from .overlap import *  # noqa: F401,F403
from .weak_learner import *  # noqa: F401,F403

__all__ = (column.__all__ + crossfit.__all__ + feature_columns.__all__ + feature_model.__all__ + features.__all__
           + files.__all__ + labels.__all__ + logistic.__all__ + overlap.__all__ + weak_learner.__all__)
