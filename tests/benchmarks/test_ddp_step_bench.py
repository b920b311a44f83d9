"""`benchmarks/tools/ddp_step_bench.py` on the CPU (its ``--tiny`` model, gloo): a one-process run and a 2-process
DDP run time CAT steps at the same mixing layers, so that their step times compare."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks", "tools", "ddp_step_bench.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

pytestmark = pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun is not installed beside python")


def _row(prefix, *extra):
    args = ["--tiny", "--methods", "cat", "--captured", "--warmup", "2", "--steps", "30", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    done = subprocess.run(prefix + [BENCH] + args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1, done.stdout
    return rows[0]


def test_one_process_times_the_layers_a_ddp_run_times():
    """The one-process baseline draws CAT's layers from the stream DDP gives every rank (it drew them from its
    partner generator before: 14 and 16 steps at layers 2 and 3 against DDP's 13 and 17 in this run)."""
    one = _row([sys.executable])
    two = _row([TORCHRUN, "--standalone", "--nproc_per_node", "2"])
    apart = _row([TORCHRUN, "--standalone", "--nproc_per_node", "2"], "--no-ddp")
    assert (one["world"], two["world"], two["ddp"], apart["ddp"]) == (1, 2, True, False)
    assert sum(one["timed_layers"].values()) == 30 and len(one["timed_layers"]) == 2
    assert one["timed_layers"] == two["timed_layers"] == apart["timed_layers"]
    assert one["timed_replays"] == one["captured_graphs"] == 0 and one["packed"] == "auto"  # the CPU: eager steps


def test_profile_writes_each_ranks_table_and_timeline(tmp_path):
    """``--profile DIR``: the operator table and a loadable Chrome trace with the profiled steps' events."""
    row = _row([sys.executable], "--profile", str(tmp_path))
    assert row["world"] == 1
    assert sorted(os.listdir(tmp_path)) == ["cat-w1-r0.json", "cat-w1-r0.txt"]
    with open(tmp_path / "cat-w1-r0.txt") as f:
        assert "Self CPU" in f.read()
    with open(tmp_path / "cat-w1-r0.json") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)


def test_no_split_makes_the_optimizer_wait_for_the_last_bucket():
    """With small buckets the captured (here eager, gloo) DDP step updates every other bucket's parameters before the
    last bucket's average is joined (``deferred``: its parameters); ``--no-split`` waits for it (the A/B switch)."""
    torchrun = [TORCHRUN, "--standalone", "--nproc_per_node", "2"]
    split = _row(torchrun, "--steps", "3", "--bucket-mb", "0.01")
    waits = _row(torchrun, "--steps", "3", "--bucket-mb", "0.01", "--no-split")
    assert split["buckets"] == waits["buckets"] > 1
    assert split["deferred"] > 0 and waits["deferred"] == 0


def test_rank_batches_step_one_process_through_each_ranks_batch_in_turn():
    """``--rank-batches 2``: the one-process baseline steps through the batches ranks 0 and 1 would take (rank 1's
    is another draw), in turn, so that a packed step's time, which follows its batch's real tokens, is compared over
    the same data; by default every step takes rank 0's."""
    import torch

    from benchmarks.tools import ddp_step_bench as bench

    model = bench.make_model(torch.device("cpu"), True)
    objective = bench.make_objective("erm", model, True, ddp=False)
    masks = []

    def call(batch, *args):
        masks.append(batch["attention_mask"])
        return objective(batch, *args)

    for rank_batches, want in ((2, [0, 1, 0, 1]), (1, [0, 0, 0, 0])):
        masks.clear()
        step, _ = bench._training_step(call, objective, model, torch.device("cpu"), 4, 32, False,
                                       rank_batches=rank_batches)
        for _ in range(4):
            step()
        firsts = [masks[i] for i in (0, 1)]
        assert rank_batches == 1 or not torch.equal(*firsts)  # two draws
        assert [next(j for j, m in enumerate(firsts) if torch.equal(m, mask)) for mask in masks] == want
