"""The spawned-ranks helper fails a test, instead of hanging it, when a rank hangs or raises."""
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.ranks import spawn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _rank_one_hangs(rank):
    if rank == 1:
        time.sleep(600)


def _rank_zero_raises(rank):
    if rank == 0:  # (rank 1 returns: a rank waiting in a collective fails too, once rank 0's connection closes)
        raise ValueError("rank zero's own error")


def test_a_hanging_rank_fails_after_the_deadline(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[1\] of 2 did not finish within 5 s"):
        spawn(_rank_one_hangs, tmp_path=tmp_path, timeout=5)
    assert time.monotonic() - t0 < 60


def test_a_failing_rank_fails_the_test_with_its_traceback(tmp_path):
    with pytest.raises(mp.ProcessRaisedException, match="rank zero's own error"):
        spawn(_rank_zero_raises, tmp_path=tmp_path, timeout=120)
