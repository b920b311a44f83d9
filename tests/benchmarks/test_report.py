"""benchmarks/report.py over small made-up results: its command line, the sections it writes, the rows it keeps."""
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "benchmarks" / "report.py"


def _step(method, size="8x128", **extra):
    b, t = (int(x) for x in size.split("x"))
    info = dict(method=method, size=size, batch=b, tokens_per_sample=t, tokens=b * t, attn="sdpa", warmup_steps=5,
                timed_steps=20, device="cuda", step_ms=10.0, peak_mib=1000.0, tokens_per_s=1e5, flop_ratio=1.5,
                tflops_per_s=100.0)
    if method != "plain":
        info.update(paired_ratio=1.25, paired_step_ms=12.5, paired_plain_ms=10.0)
    return dict(name=f"test_step[{size}-{method}]", fullname=f"test_step[{size}-{method}]", extra_info={**info, **extra})


def _op(backend, gpu_ms, shape="64x3", **extra):
    info = dict(op="cmix", backend=backend, device="cuda", shape=shape, dtype="fp32", fwd_ms=gpu_ms * 2,
                fwdbwd_ms=gpu_ms * 4, gbps=100.0, pct_copy_bw=5.0, gpu_ms=gpu_ms, pct_copy_bw_gpu=50.0, **extra)
    return dict(name=f"cmix-{backend}", fullname=f"cmix-{backend}", extra_info=info)


def _write(path, benchmarks, machine=None):
    path.write_text(json.dumps({"machine_info": {"cat_fast": machine or {"gpu": "GPU-X", "copy_gbps": 3000.0}},
                                "benchmarks": benchmarks}))
    return str(path)


def _report(*args):
    """report.py's main in this process (the command line itself: `test_the_command_line_runs`)."""
    from benchmarks import report

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = report.main(list(args))
    return subprocess.CompletedProcess(args, code, "", err.getvalue())


def test_the_command_line_runs(tmp_path):
    results = _write(tmp_path / "bench.json", [_op("cuda", 0.01)])
    done = subprocess.run([sys.executable, str(REPORT), results, "--out", str(tmp_path / "R.md"), "--plot",
                           str(tmp_path / "p.png")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"report.py: 1 records -> {tmp_path / 'R.md'}\n"
    assert "#### `cmix`" in (tmp_path / "R.md").read_text()


def test_every_step_method_of_the_suite_has_a_row(tmp_path):
    from benchmarks.steps.harness import METHODS

    results = _write(tmp_path / "bench.json", [_step(m) for m in METHODS])
    out = tmp_path / "RESULTS.md"
    done = _report(results, "--out", str(out), "--plot", str(tmp_path / "p.png"), "--date", "D")
    assert done.returncode == 0, done.stderr
    step_rows = [line for line in out.read_text().splitlines() if line.startswith("| 8×128 |")]
    assert len(step_rows) == len(METHODS)
    for label in ("PoE (bias model), CapturedStep", "CLP, head-only virtual step, CapturedStep"):
        assert any(label in row for row in step_rows), label


def test_tables_replace_only_the_marked_block_and_ratios_are_read_on_the_same_case(tmp_path):
    results = _write(tmp_path / "bench.json", [_op("cuda", 0.01, launches_fwd=1, launches_bwd=1,
                                                   launch_names_fwd=["k"], launch_names_bwd=["k"]),
                                               _op("reference", 0.04), _op("compile", 0.02),
                                               _step("plain"), _step("cat", step_ms=20.0)])
    out = tmp_path / "RESULTS.md"
    out.write_text("# kept\n\n<!-- tables:begin -->\nold\n<!-- tables:end -->\n\n## also kept\n")
    done = _report(results, "--out", str(out), "--plot", str(tmp_path / "p.png"), "--date", "D", "--full-ops")
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert text.startswith("# kept\n") and text.endswith("## also kept\n") and "old" not in text
    assert "- Device-to-device copy bandwidth" in text and "3,000 GB/s" in text
    cuda_row = next(line for line in text.splitlines() if line.startswith("| 64x3 | fp32 | cuda |"))
    assert cuda_row.split(" | ")[-4:] == ["4.00", "2.00", "2.00", "1/1 |"]  # × reference, × compile, GPU × compile
    cat_row = next(line for line in text.splitlines() if "(3) cat_fast.CAT" in line)
    assert "| 2.00 | 1.25 (12.5 / 10.0 ms) |" in cat_row  # time × (1), paired


def test_missing_inputs_are_named_and_none_found_exits_1(tmp_path):
    done = _report(str(tmp_path / "nothing.json"), "--out", str(tmp_path / "R.md"))
    assert done.returncode == 1
    assert "skipping missing input(s)" in done.stderr and "no input found" in done.stderr
    assert not (tmp_path / "R.md").exists()


@pytest.mark.parametrize("cut", [True, False])
def test_a_jsonl_backup_fills_in_cases_the_json_lacks(tmp_path, cut):
    backup = tmp_path / "bench.jsonl"
    lines = [json.dumps(_step("poe")), json.dumps(_step("poe_captured"))] + (['{"cut": '] if cut else [])
    backup.write_text("\n".join(lines) + "\n")
    results = _write(tmp_path / "bench.json", [_step("poe", step_ms=5.0)])
    done = _report(results, str(backup), "--out", str(tmp_path / "R.md"), "--plot", str(tmp_path / "p.png"))
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "R.md").read_text()
    assert "| 8×128 | (7p) PoE (bias model) | sdpa | 5.0 |" in text  # the JSON's case wins
    assert "PoE (bias model), CapturedStep" in text
