"""Benchmarks with a known answer: a label-correlated surface cue planted in labelled text data (:mod:`.plant`;
``cat-fast shortcut plant``), predictive in train and dev, anti-correlated in ``test_anti``, absent in
``test_clean``; texts cut to the truncation length first for a cue at their end (:mod:`.fit`)."""
from . import fit as _fit
from . import plant as _plant
from .fit import *  # noqa: F401,F403  (the public names are listed in fit.__all__)
from .plant import *  # noqa: F401,F403  (the public names are listed in plant.__all__)

__all__ = _plant.__all__ + _fit.__all__
