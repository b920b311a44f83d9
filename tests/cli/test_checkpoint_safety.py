"""``cat-fast train``'s checkpoints: never removing what cat-fast did not write, never running code from a file,
resuming only the same run from a complete checkpoint, and ``--out`` given as a symbolic link."""
import json
import os
import shutil

import pytest
import torch

from tests.cli.conftest import run
from tests.cli.test_own_data import _weights, own, rows, write_csv

safetensors = pytest.importorskip("safetensors.torch")


def _args(tiny, train, out, *extra):
    return own(tiny, train, out, "--save-steps", 2, "--save-total-limit", 2, "--epochs", 2, "--group-column",
               "group", *extra, method="cat")


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """An uninterrupted CAT run and one interrupted after step 5 (checkpoints 2 and 4 kept), on 16 rows."""
    from transformers import TrainerCallback

    from cat_fast.integrations import trainer as T

    base = tmp_path_factory.mktemp("ckpt")
    train = write_csv(base / "train.csv", rows(16))
    assert run(_args(tiny, train, base / "full"))[0] == 0

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 5:
                raise KeyboardInterrupt

    real = T.ObjectiveTrainer.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        self.add_callback(Stop())

    T.ObjectiveTrainer.__init__ = init
    try:
        assert run(_args(tiny, train, base / "cut"))[0] == 130
    finally:
        T.ObjectiveTrainer.__init__ = real
    folder = str(base / "cut") + ".checkpoints"
    assert sorted(n for n in os.listdir(folder) if n.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-4"]
    return {"train": train, "full": base / "full", "checkpoints": folder}


def _copy_cut(runs, tmp_path):
    out = tmp_path / "cut"
    shutil.copytree(runs["checkpoints"], str(out) + ".checkpoints")
    return out, str(out) + ".checkpoints"


def _assert_same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-6, atol=1e-6, msg=k)


def _one_error(err):
    errors = [line for line in err.splitlines() if line.startswith("cat-fast: error:")]
    assert len(errors) == 1, err
    return errors[0]


def test_save_steps_refuses_a_folder_it_did_not_write(tiny, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", rows(8))
    out = tmp_path / "exp"
    mine = tmp_path / "exp.checkpoints"
    mine.mkdir()
    (mine / "precious.txt").write_text("x")
    code, err = run(own(tiny, train, out, "--save-steps", 1, "--epochs", 1), capsys)
    assert code == 2 and "was not written by cat-fast" in _one_error(err)
    assert (mine / "precious.txt").read_text() == "x" and not out.exists()


def test_a_completed_run_removes_only_its_checkpoints(tiny, tmp_path, capsys):
    """The folder is cat-fast's (empty when the run starts); a file put in it during the run stays."""
    train = write_csv(tmp_path / "train.csv", rows(8))
    out = tmp_path / "exp"
    from cat_fast.cli import resume

    real_open = resume.CheckpointFolder.open

    def open_and_add(self, record):
        real_open(self, record)
        with open(os.path.join(self.path, "notes.txt"), "w") as f:
            f.write("mine")

    resume.CheckpointFolder.open = open_and_add
    try:
        code, err = run(own(tiny, train, out, "--save-steps", 1, "--epochs", 1), capsys)
    finally:
        resume.CheckpointFolder.open = real_open
    assert code == 0, err
    assert os.listdir(str(out) + ".checkpoints") == ["notes.txt"]
    empty = tmp_path / "empty.checkpoints"  # an empty folder may be used, and goes when the run completes
    empty.mkdir()
    assert run(own(tiny, train, tmp_path / "empty", "--save-steps", 1, "--epochs", 1), capsys)[0] == 0
    assert not empty.exists()


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_resume_runs_no_code_from_the_objective_file(runs, tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out, folder = _copy_cut(runs, tmp_path)
    path = os.path.join(folder, "checkpoint-4", "cat_fast_objective.pt")
    torch.save({"step": _Payload()}, path)  # a pickle that runs a command when unpickled
    manifest = os.path.join(folder, "checkpoint-4", "cat_fast_complete.json")
    with open(manifest) as f:
        m = json.load(f)
    m["files"]["cat_fast_objective.pt"] = os.path.getsize(path)  # the attacker rewrites the manifest too
    with open(manifest, "w") as f:
        json.dump(m, f)
    code, err = run(_args(tiny, runs["train"], out, "--resume"), capsys)
    assert code == 2 and "cannot read the objective's state" in _one_error(err)
    assert not (tmp_path / "PWNED").exists() and not out.exists()


def test_resume_refuses_a_checkpoint_without_the_objective_state(runs, tiny, tmp_path, capsys):
    """A checkpoint whose manifest lists no objective state (written without it) is refused, not resumed with a
    fresh generator."""
    out, folder = _copy_cut(runs, tmp_path)
    os.remove(os.path.join(folder, "checkpoint-4", "cat_fast_objective.pt"))
    manifest = os.path.join(folder, "checkpoint-4", "cat_fast_complete.json")
    with open(manifest) as f:
        m = json.load(f)
    del m["files"]["cat_fast_objective.pt"]
    with open(manifest, "w") as f:
        json.dump(m, f)
    code, err = run(_args(tiny, runs["train"], out, "--resume"), capsys)
    line = _one_error(err)
    assert code == 2 and "--resume" in line and "no cat_fast_objective.pt" in line and not out.exists()


def test_resume_takes_the_newest_complete_checkpoint(runs, tiny, tmp_path, capsys):
    """An interrupted save leaves a staging folder and, at worst, a checkpoint without its manifest: the resume
    takes checkpoint 2, ends at the uninterrupted run's weights, and needs no --save-steps."""
    out, folder = _copy_cut(runs, tmp_path)
    os.remove(os.path.join(folder, "checkpoint-4", "cat_fast_complete.json"))  # checkpoint 4 is now incomplete
    os.makedirs(os.path.join(folder, ".partial-checkpoint-6", "checkpoint-6"))
    code, err = run(own(tiny, runs["train"], out, "--epochs", 2, "--group-column", "group", "--resume",
                        method="cat"), capsys)
    assert code == 0, err
    _assert_same_weights(runs["full"], out)
    assert not os.path.exists(folder)  # the run is complete: its checkpoints are removed


@pytest.mark.parametrize("extra, named", [
    (["--method", "erm"], "--method"),
    (["--epochs", 1], "--epochs"),
    (["--lr", 1e-4], "--lr"),
    (["--seed", 3], "--seed"),
])
def test_resume_refuses_another_run(runs, tiny, tmp_path, capsys, extra, named):
    out, _ = _copy_cut(runs, tmp_path)
    code, err = run(_args(tiny, runs["train"], out, "--resume", *extra), capsys)
    line = _one_error(err)
    assert code == 2 and named in line and "checkpoint:" in line and not out.exists(), line


def test_resume_refuses_other_training_rows_and_another_model(runs, tmp_path, capsys, tiny):
    out, _ = _copy_cut(runs, tmp_path)
    other = write_csv(tmp_path / "train.csv", rows(16, seed=5))
    code, err = run(_args(tiny, other, out, "--resume"), capsys)
    assert code == 2 and "the training rows" in _one_error(err)
    shutil.copytree(tiny, tmp_path / "other_model")
    code, err = run(_args(str(tmp_path / "other_model"), runs["train"], out, "--resume"), capsys)
    assert code == 2 and "--model" in _one_error(err)


def test_a_new_run_refuses_another_runs_checkpoints(runs, tiny, tmp_path, capsys):
    out, folder = _copy_cut(runs, tmp_path)
    code, err = run(_args(tiny, runs["train"], out), capsys)
    assert code == 2 and "pass --resume" in _one_error(err)
    assert sorted(n for n in os.listdir(folder) if n.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-4"]


def test_a_non_finite_run_leaves_no_checkpoint(tiny, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", rows())
    out = tmp_path / "o"
    code, err = run(own(tiny, train, out, "--lr", "1e30", "--weight-decay", 0, "--max-grad-norm", 0, "--epochs", 3,
                        "--save-steps", 1),
                    capsys)
    assert code == 3 and "no output written" in _one_error(err)
    assert not out.exists() and not os.path.exists(str(out) + ".checkpoints")


def test_out_as_a_symbolic_link(tiny, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", rows(8))
    target = tmp_path / "real"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    assert run(own(tiny, train, link, "--epochs", 1, "--no-checkpoint"), capsys)[0] == 0
    assert link.is_symlink() and (target / "metrics.json").exists()
    before = (target / "metrics.json").read_text()
    assert run(own(tiny, train, link, "--epochs", 1, "--no-checkpoint", "--seed", 1, "--overwrite"), capsys)[0] == 0
    assert link.is_symlink() and (target / "metrics.json").read_text() != before
    assert sorted(os.listdir(tmp_path)) == ["link", "real", "train.csv"]  # no .old link or folder left
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    code, err = run(own(tiny, train, dangling, "--epochs", 1), capsys)
    assert code == 2 and "does not exist" in _one_error(err) and not (tmp_path / "nowhere").exists()


def test_resume_without_save_steps_and_without_checkpoints(tiny, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", rows(8))
    code, err = run(own(tiny, train, tmp_path / "o", "--resume"), capsys)
    assert code == 2 and "no complete checkpoint" in _one_error(err)
