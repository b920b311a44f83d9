"""``cat-fast train`` under ``torchrun --standalone --nproc_per_node 2`` (gloo, CPU): one epoch's batches dealt out
to the ranks, metrics.json written once by rank 0, and --resume from a checkpoint continuing the run exactly."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.cli.test_own_data import _weights, own, write_csv
from tests.cli.test_own_data import rows as make_rows

pytestmark = pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(
    os.path.join(os.path.dirname(sys.executable), "torchrun")), reason="torchrun is not installed")

# cli.main in each rank; with STOP_AT set, every rank stops (KeyboardInterrupt) after that optimizer step
SCRIPT = """
import os, sys
from transformers import TrainerCallback
from cat_fast import cli
from cat_fast.integrations import trainer as T

stop = int(os.environ.get("STOP_AT", "0"))
if stop:
    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == stop:
                raise KeyboardInterrupt
    real = T.ObjectiveTrainer.__init__
    def init(self, *a, **k):
        real(self, *a, **k)
        self.add_callback(Stop())
    T.ObjectiveTrainer.__init__ = init
bucket_file = os.environ.get("BUCKET_FILE")
if bucket_file:  # rank 0 writes the gradient bucket size of the DDP wrapper the Trainer trains through
    class Bucket(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if os.environ.get("RANK") == "0":
                with open(bucket_file, "w") as f:
                    f.write(f"{type(self.trainer.model_wrapped).__name__} {self.trainer.model_wrapped.bucket_bytes_cap}")
    real_init = T.ObjectiveTrainer.__init__
    def init_bucket(self, *a, **k):
        real_init(self, *a, **k)
        callback = Bucket()
        callback.trainer = self
        self.add_callback(callback)
    T.ObjectiveTrainer.__init__ = init_bucket
sys.exit(cli.main(sys.argv[1:]))
"""


def _torchrun(tmp_path, argv, **env):
    script = tmp_path / "rank_main.py"
    script.write_text(SCRIPT)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun if os.path.exists(torchrun) else "torchrun", "--standalone", "--nproc_per_node", "2",
           str(script)] + [str(a) for a in argv]
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(), **env}
    return subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=300)


def test_two_processes_train_write_once_and_resume(tiny, tmp_path):
    train = write_csv(tmp_path / "train.csv", make_rows(32))
    dev = write_csv(tmp_path / "dev.csv", make_rows(9, seed=1))
    args = lambda out: own(tiny, train, out, "--epochs", 2, "--group-column", "group", "--save-steps", 2,  # noqa
                           "--device", "cpu", "--warmup-epochs", 0, "--dev", dev, "--cat-layers", "1,2",
                           "--ddp-bucket-mb", 3, method="cat")  # two mixing layers: the shared layer stream is resumed too
    full = _torchrun(tmp_path, args(tmp_path / "full"), BUCKET_FILE=str(tmp_path / "bucket.txt"))
    assert full.returncode == 0, full.stderr[-3000:]
    assert (tmp_path / "bucket.txt").read_text() == f"DistributedDataParallel {3 * 1024 * 1024}"  # --ddp-bucket-mb
    m = json.loads((tmp_path / "full" / "metrics.json").read_text())
    # 32 examples in groups of 2, batches of 4: 8 batches per epoch, 4 per rank, so 4 steps per epoch
    assert m["steps"] == 8 and [h["step"] for h in m["history"]] == [4, 8]
    assert m["config"]["processes"] == 2 and m["config"]["global_batch_size"] == 8
    assert [h["eval"]["dev"]["n"] for h in m["history"]] == [9, 9]  # rank 0 evaluated at each epoch's end
    assert all(h["objective"] == "cat" and h["info"]["cat_active"] == 1 for h in m["history"])
    assert full.stderr.count("cat-fast: wrote") == 1  # rank 0 alone writes and reports
    assert not os.path.exists(str(tmp_path / "full") + ".checkpoints")
    assert [p for p in os.listdir(tmp_path) if p.startswith((".full", "cat-fast-rank"))] == []

    cut = _torchrun(tmp_path, args(tmp_path / "cut"), STOP_AT="3")
    assert cut.returncode != 0 and not os.path.exists(tmp_path / "cut")
    kept = str(tmp_path / "cut") + ".checkpoints"
    assert os.path.isfile(os.path.join(kept, "checkpoint-2", "cat_fast_objective.rank1.pt"))
    resumed = _torchrun(tmp_path, args(tmp_path / "cut") + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "cut")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-6, msg=k)
    mc = json.loads((tmp_path / "cut" / "metrics.json").read_text())
    assert mc["steps"] == 8 and mc["eval"] == m["eval"]


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=TWO_GPUS)])
def test_step_graphs_under_torchrun_equal_the_ddp_forward_route(tiny, tmp_path, device):
    """Step graphs under torchrun: each step runs outside DDP's forward and averages its gradients itself
    (`cat_fast.step_ddp`; eager on the CPU with ``--step-graphs``, one CUDA graph per shape on 2 GPUs by default).
    The weights equal those of the route through DDP's forward (``--no-step-graphs``), the run says it took the
    captured step, and every rank leaves its process group (graphs holding NCCL collectives dropped first)."""
    train = write_csv(tmp_path / "train.csv", make_rows(32))
    args = lambda out, *extra: own(tiny, train, out, "--epochs", 1, "--device", device, "--lr", 1e-3,  # noqa
                                   *extra, method="erm")
    plain = _torchrun(tmp_path, args(tmp_path / "plain", "--no-step-graphs"))
    assert plain.returncode == 0, plain.stderr[-3000:]
    graphs = _torchrun(tmp_path, args(tmp_path / "graphs", *(["--step-graphs"] if device == "cpu" else [])))
    assert graphs.returncode == 0, graphs.stderr[-3000:]
    assert "eager training step runs" not in graphs.stderr
    assert json.loads((tmp_path / "graphs" / "metrics.json").read_text())["config"]["step_graphs"] is True
    a, b = _weights(tmp_path / "plain"), _weights(tmp_path / "graphs")
    start = _weights(tiny)
    assert any(not torch.equal(a[k], start[k]) for k in a if k in start)  # it trained
    tol = dict(rtol=1e-5, atol=1e-6) if device == "cpu" else dict(rtol=1e-4, atol=2e-5)
    for k in a:
        torch.testing.assert_close(b[k], a[k], **tol, msg=k)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_equal_one_node_of_two_processes(tiny, tmp_path):
    """``torchrun --nnodes 2 --node_rank {0,1} --nproc_per_node 1`` (two agents, as on two machines, here on one
    host over the loopback): the same ranks, batches and result as ``--standalone --nproc_per_node 2``; node 1
    writes nothing."""
    train = write_csv(tmp_path / "train.csv", make_rows(24))
    dev = write_csv(tmp_path / "dev.csv", make_rows(6, seed=1))
    args = lambda out: [str(a) for a in own(tiny, train, out, "--epochs", 1, "--group-column", "group",  # noqa
                                             "--device", "cpu", "--warmup-epochs", 0, "--dev", dev,
                                             "--cat-layers", "1,2", method="cat")]
    one = _torchrun(tmp_path, args(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    script = tmp_path / "rank_main.py"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = _free_port()
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    agents = [subprocess.Popen(
        [torchrun if os.path.exists(torchrun) else "torchrun", "--nnodes", "2", "--node_rank", str(node),
         "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port), str(script)]
        + args(tmp_path / "two"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)
        for node in (0, 1)]
    outputs = [a.communicate(timeout=300) for a in agents]
    for agent, (_, err) in zip(agents, outputs):
        assert agent.returncode == 0, err[-3000:]
    assert outputs[0][1].count("cat-fast: wrote") == 1 and "cat-fast: wrote" not in outputs[1][1]
    m1 = json.loads((tmp_path / "one" / "metrics.json").read_text())
    m2 = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert m2["config"]["processes"] == 2 and m2["steps"] == m1["steps"] and m2["eval"] == m1["eval"]
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)


def test_a_gradient_exchange_that_is_not_one_is_refused_before_the_run(tiny, tmp_path):
    """CAT_FAST_GRADIENT_EXCHANGE=nvlink: every rank ends in one line naming the variable (exit 2), and nothing
    is written."""
    train = write_csv(tmp_path / "train.csv", make_rows(16))
    args = own(tiny, train, tmp_path / "out", "--epochs", 1, "--device", "cpu", "--warmup-epochs", 0, method="erm")
    done = _torchrun(tmp_path, args, CAT_FAST_GRADIENT_EXCHANGE="nvlink")
    assert done.returncode != 0
    line = ("cat-fast: error: exchange: expected one of ('auto', 'nccl', 'copy'), got 'nvlink' (from the environment "
            "variable CAT_FAST_GRADIENT_EXCHANGE)")
    assert done.stderr.count(line) == 2, done.stderr[-3000:]
    assert "exitcode  : 2" in done.stderr and "ValueError" not in done.stderr  # (torchrun's own traceback follows)
    assert sorted(os.listdir(tmp_path)) == ["rank_main.py", "train.csv"]
