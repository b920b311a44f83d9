"""Device check of a test's power: the GPU test of CAT's CAL graphs under a forward wrapped in autocast must fail
when `models.graph_capture` leaves autocast's weight cache alone (the bug it guards). Exit 0 when it fails so.
On a GPU machine: python scripts/check_cache_test_power.py"""
import contextlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.getcwd())
from cat_fast import models  # noqa: E402
from cat_fast.models import masks  # noqa: E402


@contextlib.contextmanager
def capture_without_clearing(graph, pool=None):
    with masks.capture_safe_masks(), torch.cuda.graph(graph, pool=pool):
        yield graph


models.graph_capture = capture_without_clearing
code = pytest.main(["-q", "-p", "no:cacheprovider",
                    "tests/objectives/test_cat_graphs.py::test_a_forward_wrapped_in_autocast_replays_the_eager_steps"])
print("power check:", "the test fails without the cache clearing (good)" if code != 0 else "the test PASSED without "
      "the fix: it does not guard the bug")
sys.exit(0 if code != 0 else 1)
