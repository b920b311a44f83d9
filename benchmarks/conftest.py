"""Fixtures and hooks of the benchmark suite (see benchmarks/_harness.py for how timing works).

* `copy_bandwidth`: session fixture, device-to-device copy GB/s (read + write) measured once per run.
* Machine info in `--benchmark-json` gains the GPU name, torch / CUDA / triton / transformers
  versions, cat_fast backends and the measured copy bandwidth.
* Time budget: cases marked `bench_ops` / `bench_step` skip once CAT_FAST_BENCH_DEADLINE_OPS /
  CAT_FAST_BENCH_DEADLINE_STEP (UNIX time) has passed, so a run always leaves time for the report.
* Without the pytest-benchmark plugin, a minimal stand-in `benchmark` fixture and `--benchmark-json`
  option write the same JSON layout (benchmarks[].extra_info, .stats.median; machine_info).
"""
import datetime
import importlib.util
import json
import os
import platform
import subprocess

import pytest
import torch

from benchmarks import _harness

# CAT_FAST_BENCH_STANDIN=1 (with `-p no:benchmark`) exercises the stand-in where the plugin is installed.
HAVE_PLUGIN = importlib.util.find_spec("pytest_benchmark") is not None and os.environ.get("CAT_FAST_BENCH_STANDIN") != "1"


def environment_info():
    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "hostname": platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_count"] = torch.cuda.device_count()
    for module in ("triton", "transformers"):
        try:
            info[module] = __import__(module).__version__
        except Exception:
            info[module] = None
    try:
        import cat_fast

        info["cat_fast_backends"] = list(cat_fast.backends())
        info["cat_fast_load_errors"] = cat_fast.ops.registry.load_errors()
    except Exception as error:  # pragma: no cover - reported, not fatal
        info["cat_fast_backends"] = f"import failed: {error}"
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip() or None
    except Exception:
        info["git_commit"] = None
    if os.environ.get("CAT_FAST_BENCH_COMMIT"):
        info["git_commit"] = os.environ["CAT_FAST_BENCH_COMMIT"]
    copy = _harness.measured_copy_bandwidth()
    if copy:
        info["copy_gbps"] = copy["gbps"]
        info["copy_bytes"] = copy["bytes"]
    return info


def pytest_configure(config):
    config.addinivalue_line("markers", "bench_ops: op-level benchmark case (time budget CAT_FAST_BENCH_DEADLINE_OPS)")
    config.addinivalue_line("markers", "bench_step: step-level benchmark case (time budget CAT_FAST_BENCH_DEADLINE_STEP)")
    if not HAVE_PLUGIN:
        config.addinivalue_line("markers", "benchmark(**kwargs): pytest-benchmark options (ignored by the stand-in)")
        config._cat_fast_benchmarks = []


def _order(item):
    """Run order: op cases of the fused/eager backends, then torch.compile op cases (slow to set up), then steps."""
    if item.get_closest_marker("bench_step"):
        return 2
    params = getattr(getattr(item, "callspec", None), "params", {})
    return 1 if params.get("backend") == "compile" else 0


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=_order)  # stable: file and parametrisation order kept within each class


def pytest_runtest_setup(item):
    for kind in ("ops", "step"):
        if item.get_closest_marker(f"bench_{kind}") and _harness.deadline_passed(kind):
            pytest.skip(f"time budget for {kind} benchmarks exhausted (CAT_FAST_BENCH_DEADLINE_{kind.upper()})")


@pytest.fixture(scope="session")
def copy_bandwidth():
    """GB/s of a 512 MiB device-to-device copy (bytes read + written), None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return _harness.copy_bandwidth_gbps()


if HAVE_PLUGIN:

    def pytest_benchmark_update_machine_info(config, machine_info):
        machine_info["cat_fast"] = environment_info()

else:

    def pytest_addoption(parser):
        parser.addoption("--benchmark-json", default=None, help="(stand-in) write results as JSON here")
        for flag in ("--benchmark-disable", "--benchmark-skip"):
            parser.addoption(flag, action="store_true", default=False, help="(stand-in) accepted, ignored")

    class _StandInBenchmark:
        def __init__(self, node, sink):
            self.name = node.name
            self.fullname = node.nodeid
            self.params = {k: str(v) for k, v in getattr(getattr(node, "callspec", None), "params", {}).items()}
            self.group = None
            self.extra_info = {}
            self._sink = sink

        def pedantic(self, target, args=(), kwargs=None, rounds=1, iterations=1, warmup_rounds=0, **_):
            start = _harness.virtual_clock()
            result = target(*args, **(kwargs or {}))
            seconds = _harness.virtual_clock() - start
            stats = {k: seconds for k in ("min", "max", "mean", "median")}
            stats.update(rounds=1, iterations=1, stddev=0.0)
            self._sink.append(
                {"group": self.group, "name": self.name, "fullname": self.fullname, "params": self.params,
                 "extra_info": self.extra_info, "stats": stats}
            )
            return result

    @pytest.fixture
    def benchmark(request):
        return _StandInBenchmark(request.node, request.config._cat_fast_benchmarks)

    def pytest_sessionfinish(session, exitstatus):
        path = session.config.getoption("--benchmark-json")
        if path:
            data = {"machine_info": {"cat_fast": environment_info()}, "commit_info": {},
                    "benchmarks": session.config._cat_fast_benchmarks, "datetime": datetime.datetime.now().isoformat(),
                    "version": "cat_fast-stand-in"}
            with open(path, "w") as handle:
                json.dump(data, handle, indent=2, default=str)
