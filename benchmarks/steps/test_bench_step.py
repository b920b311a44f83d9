"""Step-level benchmarks: one training step of BERT-base (random weights, bf16 autocast, AdamW) per method and size.

The methods (`harness.METHODS`, built from the objective registry; the list in `harness`'s docstring), the sizes
and step counts (`setting`), and what a case records (`measure`) live beside this file; `benchmarks/report.py`
reads the records into benchmarks/RESULTS.md by their case ids (``{size}-{method}``).
`test_cat_host_sync` runs one CAT step (and, for attribution, one plain step) under
torch.cuda.set_sync_debug_mode("error") and records whether it raised. Errors and OOM are recorded per case
(extra_info["error"]) and do not stop the run. CAT_FAST_BENCH_STEP_CPU=1 runs the same code on the CPU with a tiny
BERT (a smoke test of the benchmark code, no meaningful numbers).
"""
import warnings

import pytest

from benchmarks import _harness as H
from benchmarks.steps.harness import COMPILED_METHODS, GS_LONG_METHODS, METHODS
from benchmarks.steps.measure import measure_step, measure_sync
from benchmarks.steps.setting import CPU_SMOKE, LONG_SIZE, SIZES, SKIP

pytestmark = [pytest.mark.benchmark(timer=H.virtual_clock), pytest.mark.bench_step]


def _param(method, size):
    marks = [pytest.mark.skip(reason=SKIP)] if SKIP else []
    if CPU_SMOKE and method in COMPILED_METHODS:
        marks = [pytest.mark.skip(reason="torch.compile rows: GPU only (minutes of CPU compilation in a smoke run)")]
    return pytest.param(method, size, id=f"{size}-{method}", marks=marks)


@pytest.mark.parametrize("method,size", [_param(method, size) for size in SIZES for method in METHODS]
                         + [_param(method, LONG_SIZE) for method in GS_LONG_METHODS])
def test_step(benchmark, method, size):
    info = H.record(benchmark, measure_step(method, size), group=f"step {size}", method=method, size=size)
    H.finish(info)


@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
def test_cat_host_sync(benchmark):
    size = SIZES[0]
    info = H.record(benchmark, measure_sync(size), group="host sync", method="cat_sync_check", size=size)
    H.finish(info)
    if info.get("sync_cat_nomask_raised"):
        warnings.warn(f"CAT step synchronises with the host: {info.get('sync_cat_nomask')}")
