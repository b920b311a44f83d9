"""benchmarks/studies/shortcuts.py: the jobs it plans, the runs it skips, how it spreads them over GPUs, and the
report it writes from metrics.json files (written here; nothing is trained)."""
import importlib.util
import json
import os
import pathlib
import shlex
import threading
import types

import pytest

DRIVER = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "studies" / "shortcuts.py"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("shortcuts_study", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def planted(tmp_path):
    d = tmp_path / "planted"
    d.mkdir()
    (d / "shortcut.json").write_text(json.dumps({"cue": "token:zeugma@start", "field": "text", "strength": 0.9,
                                                 "cue_class": "neg", "labels": ["neg", "pos"], "seed": 0,
                                                 "pairs": False}))
    return str(d)


def metrics(root, method, seed, anti, clean, dev):
    d = pathlib.Path(root) / method / f"seed{seed}"
    d.mkdir(parents=True)
    evals = {"anti": {"accuracy": anti, "n": 10}, "clean": {"accuracy": clean, "n": 10},
             "dev": {"accuracy": dev, "n": 10}}
    (d / "metrics.json").write_text(json.dumps({"method": method, "eval": evals}))


def test_plan_runs_every_method_and_seed_with_the_planted_files(study, planted, tmp_path):
    root = str(tmp_path / "runs")
    jobs = study.plan(planted, ["poe", "conf-reg"], [0, 1], root)
    names = [j.name for j in jobs]
    assert names == ["bias"] + [f"{m}-seed{s}" for s in (0, 1) for m in ("ceiling", "erm", "poe", "conf-reg")]
    bias = jobs[0]
    assert bias.command.startswith(study.BIAS_FIT + f" --train {planted}/train.jsonl ") and bias.phase == 0
    assert "--id-column id" in bias.command and bias.out == f"{root}/bias"
    by_name = {j.name: j for j in jobs}
    for job in jobs[1:]:
        argv = shlex.split(job.command)
        assert argv[:2] == ["cat-fast", "train"]
        assert f"--dev {planted}/dev.jsonl --eval anti={planted}/test_anti.jsonl clean={planted}/test_clean.jsonl" \
            in job.command
        assert "--labels neg,pos" in job.command and "--id-column id" in job.command
        assert argv[-2:] == ["--out", job.out] and job.out == f"{root}/{job.name.replace('-seed', '/seed')}"
    assert f"--train {planted}/train_clean.jsonl" in by_name["ceiling-seed0"].command
    assert "--method erm" in by_name["ceiling-seed0"].command
    assert f"--bias {root}/bias" in by_name["poe-seed1"].command
    assert f"--teacher {root}/erm/seed1" in by_name["conf-reg-seed1"].command
    assert "--no-checkpoint" not in by_name["erm-seed1"].command  # conf-reg's teacher
    assert [j.phase for j in jobs[1:5]] == [0, 0, 1, 1]
    plain = study.plan(planted, ["erm"], [0], root, ceiling=False)
    assert [j.name for j in plain] == ["erm-seed0"] and "--no-checkpoint" in plain[0].command


def test_train_commands_parse_as_cat_fast_train(study, planted, tmp_path):
    from cat_fast import cli

    for job in study.plan(planted, ["erm", "poe"], [3], str(tmp_path / "runs"))[1:]:
        args = cli.build_parser().parse_args(shlex.split(job.command)[1:])
        assert args.eval == [f"anti={planted}/test_anti.jsonl", f"clean={planted}/test_clean.jsonl"]
        assert (args.seed, args.labels, args.id_column) == (3, ["neg", "pos"], "id")


def test_pairs_and_groups_name_their_columns(study, planted):
    assert "--text-pair-column" not in study.data_flags(planted) and "--group-column" not in study.data_flags(planted)
    meta = json.loads(open(os.path.join(planted, "shortcut.json")).read())
    with open(os.path.join(planted, "shortcut.json"), "w") as f:
        json.dump(dict(meta, pairs=True, groups=True), f)
    assert study.data_flags(planted) == ("--text-column text --text-pair-column text_pair --label-column label "
                                         "--group-column group --id-column id --labels neg,pos")


def test_finished_runs_are_skipped_and_jobs_spread_over_gpus(study, planted, tmp_path, monkeypatch):
    root = str(tmp_path / "runs")
    metrics(root, "erm", 0, 0.5, 0.9, 0.95)
    jobs = study.plan(planted, ["erm", "poe"], [0, 1], root)
    assert [j.name for j in jobs if j.finished] == ["erm-seed0"]
    calls, together = [], threading.Barrier(4, timeout=20)

    def fake_run(argv, env, stdout, stderr):
        calls.append((argv[3:5], env.get("CUDA_VISIBLE_DEVICES")))
        if len(calls) <= 4:
            together.wait()  # phase 0's 4 jobs run at once: 2 per GPU
        return types.SimpleNamespace(returncode=0 if argv[3] == "train" else 1)

    monkeypatch.setattr(study.subprocess, "run", fake_run)
    status = study.run_jobs([j for j in jobs if not j.finished], ["0", "1"], 2, str(tmp_path / "logs"))
    assert sorted(status) == sorted(j.name for j in jobs if not j.finished) and status["bias"] == 1
    assert {tuple(c[0]) for c in calls[:4]} == {("bias", "fit"), ("train", "--method")}  # bias, ceiling, erm
    assert sorted(c[1] for c in calls[:4]) == ["0", "0", "1", "1"]
    assert len(calls) == 6 and all(c[0] == ["train", "--method"] for c in calls[4:])  # then poe
    assert (tmp_path / "logs" / "poe-seed1.log").read_text().startswith("cat-fast train --method poe")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert study.visible_gpus() == ["2", "3"]
    cpu = []
    monkeypatch.setattr(study.subprocess, "run", lambda argv, env, stdout, stderr: cpu.append(
        env.get("CUDA_VISIBLE_DEVICES")) or types.SimpleNamespace(returncode=0))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    study.run_jobs(jobs[1:2], [], 4, str(tmp_path / "logs"))
    assert cpu == [None]  # no GPU: one at a time, the environment's devices untouched


def test_report_table_from_metrics(study, planted, tmp_path):
    root = str(tmp_path / "runs")
    metrics(root, "erm", 0, 0.20, 0.80, 0.90)
    metrics(root, "erm", 1, 0.30, 0.90, 0.92)
    metrics(root, "poe", 0, 0.60, 0.85, 0.80)
    metrics(root, "ceiling", 0, 0.85, 0.86, 0.70)
    (pathlib.Path(root) / "poe" / "seed1").mkdir()  # unfinished: no metrics.json
    (pathlib.Path(root) / "logs").mkdir()
    table = study.report(root, planted, ["poe", "erm"])
    assert table.splitlines() == [
        "Cue `token:zeugma@start` in text, strength 0.9, predicting `neg` (seed 0).",
        "",
        "| method | seeds | anti | clean | biased dev | clean − anti |",
        "| --- | --- | --- | --- | --- | --- |",
        "| poe | 1 | 60.0 ± 0.0 | 85.0 ± 0.0 | 80.0 ± 0.0 | 25.0 ± 0.0 |",
        "| erm | 2 | 25.0 ± 7.1 | 85.0 ± 7.1 | 91.0 ± 1.4 | 60.0 ± 0.0 |",
        "| ceiling (ERM, no cue) | 1 | 85.0 ± 0.0 | 86.0 ± 0.0 | 70.0 ± 0.0 | 1.0 ± 0.0 |",
    ]
    out = tmp_path / "report" / "table.md"
    assert study.main([planted, "--root", root, "--methods", "erm", "--report", str(out)]) == 0
    assert out.read_text().splitlines()[4].startswith("| erm | 2 |")


def test_masking_route_unlearning_and_the_combination(study, planted, tmp_path):
    """mask (phase 1), then mask-random, unlearn and poe+mask (phase 2): each command parses as its cat-fast
    subcommand; poe's model is kept for its own mediation; unlearning reads the bias model and the chosen k."""
    import re

    from cat_fast import cli

    root = str(tmp_path / "runs")
    jobs = {j.name: j for j in study.plan(planted, ["mask", "mask-random", "unlearn", "poe+mask"], [0], root)}
    assert {"bias", "erm-seed0", "poe-seed0", "mask-seed0", "mask-random-seed0", "unlearn-seed0",
            "poe+mask-seed0"} <= set(jobs)
    assert "--no-checkpoint" not in jobs["poe-seed0"].command and "--no-checkpoint" not in jobs["erm-seed0"].command
    assert jobs["mask-seed0"].phase == 1 and {jobs[n].phase for n in ("mask-random-seed0", "unlearn-seed0",
                                                                       "poe+mask-seed0")} == {2}
    assert f"--model {root}/poe/seed0 " in jobs["poe+mask-seed0"].command
    assert jobs["poe+mask-seed0"].out == f"{root}/poe+mask/seed0"
    unlearn = jobs["unlearn-seed0"].command
    assert f"--bias {root}/bias" in unlearn and f"{{chosen_k:{root}/mask-work/seed0/model/k_selection.json}}" in unlearn
    parser = cli.build_parser()
    for name in ("mask-seed0", "mask-random-seed0", "unlearn-seed0", "poe+mask-seed0"):
        for part in jobs[name].command.split(" ;; "):
            argv = shlex.split(re.sub(r"\{chosen_k:[^}]+\}", "7", part))
            assert argv[0] == "cat-fast"
            parser.parse_args(argv[1:])
