"""Benchmarks with a known answer: a label-correlated surface cue planted in labelled text data (:mod:`.plant`;
``cat-fast shortcut plant``), predictive in train and dev, anti-correlated in ``test_anti``, absent in
``test_clean``."""
from .plant import *  # noqa: F401,F403  (the public names are listed in plant.__all__)
from .plant import __all__  # noqa: F401
