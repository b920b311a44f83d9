"""Runs a test's body on several spawned processes, one per rank, so that a hang fails the test instead of the run.

Two hazards of spawned process groups, each seen as a CI run that never finished:

- A rank stuck in a collective blocks ``mp.spawn(..., join=True)`` for ever. ``spawn`` gives the processes a
  deadline, kills them after it and fails the test; the process group's own timeout (``PG_TIMEOUT``) turns a
  mismatched collective into an error on the rank first.
- Tear-down order. A DDP module's reducer holds a reference to the process group. When the reducer outlives
  ``destroy_process_group`` (a trainer still referenced by the worker's frame), its deallocation runs with the GIL
  held and drops the group's last reference; gloo's destructor then joins its worker threads, and a worker thread
  that is still releasing the tensor of a finished collective (a Python tensor: it needs the GIL) never finishes.
  Seen in 2 of 8 runs of a 2-rank trainer test on 2 cores (torch 2.11). ``_rank_main`` runs the body in its own
  frame, lets that frame and any exception's frames go, collects garbage, and only then destroys the group, so its
  last reference goes in ``destroy_process_group``, whose binding releases the GIL.
"""
import gc
import os
import time
import traceback
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PG_TIMEOUT = timedelta(seconds=120)


def _rank_main(rank, body, init, world, backend, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    if backend == "nccl":  # one GPU per rank, chosen before the group's first collective
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=PG_TIMEOUT)
    failure = None
    try:
        body(rank, *args)
    except BaseException as exc:  # reported below, once the group is gone
        failure = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    gc.collect()
    dist.destroy_process_group()
    if failure is not None:
        raise RuntimeError(f"rank {rank} failed:\n{failure}")


def spawn(body, *args, tmp_path, world=2, backend="gloo", timeout=300):
    """Runs ``body(rank, *args)`` on ``world`` spawned processes joined in one process group (``backend``, a file
    rendezvous under ``tmp_path``). ``body`` must be a module-level function; it may leave objects that hold the
    group (DDP modules, trainers) to its frame. Fails if a rank raises or if the ranks are not done in ``timeout``
    seconds (their processes are killed first)."""
    init = f"file://{tmp_path / f'rendezvous-{uuid.uuid4().hex}'}"
    context = mp.start_processes(_rank_main, args=(body, init, world, backend, args), nprocs=world, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.5, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            stuck = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            for p in context.processes:
                p.join(10)
            raise AssertionError(f"ranks {stuck} of {world} did not finish within {timeout} s (stuck in a "
                                 "collective or in the process group's tear-down); their processes were killed")
