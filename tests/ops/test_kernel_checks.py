"""Each op's argument checks are written once, in csrc/checks/<op>.h, and shared by its CPU and CUDA kernels; a
direct `torch.ops.cat_fast.*` call that breaks them names the argument as the Python wrapper does."""
import json
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import cat_fast
from cat_fast.ops import registry

CSRC = pathlib.Path(__file__).parents[2] / "csrc"
OPS = sorted(path.stem for path in (CSRC / "cpu").glob("*.cpp"))
# The only TORCH_CHECK left in a kernel source: the CPU kernels' per-row label range (values, read in the loop).
ROW_LABEL_CHECK = re.compile(r"TORCH_CHECK\((ignored \|\| )?\(?y >= 0 && y < C\)?,")


def _registering_cuda_sources(op):
    """The CUDA sources of `op` that register its kernels (the ones that take the checks)."""
    sources = [CSRC / "cuda" / f"{op}.cu", *sorted((CSRC / "cuda").glob(f"{op}_*.cu"))]
    return [s for s in sources if s.exists() and "TORCH_LIBRARY_IMPL" in s.read_text()]


@pytest.mark.parametrize("op", OPS)
def test_cpu_and_cuda_sources_share_the_op_checks(op):
    header = CSRC / "checks" / f"{op}.h"
    assert header.exists(), f"{op}: no csrc/checks/{op}.h"
    assert "namespace checks" in header.read_text()
    include = f'#include "checks/{op}.h"'
    cpu = (CSRC / "cpu" / f"{op}.cpp").read_text()
    cuda = _registering_cuda_sources(op)
    assert include in cpu
    assert cuda, f"{op}: no CUDA source registers it"
    for source in cuda:
        assert include in source.read_text(), source.name
    leftover = [line.strip() for line in cpu.splitlines() if "TORCH_CHECK" in line and not ROW_LABEL_CHECK.search(line)]
    assert leftover == [], f"csrc/cpu/{op}.cpp checks arguments itself: {leftover}"
    for source in sorted((CSRC / "cuda").glob(f"{op}*.cu")):
        assert "TORCH_CHECK" not in source.read_text(), f"{source.name} checks arguments itself"


def test_cuda_sources_are_split_by_job():
    """No CUDA source of more than ~500 lines (cmix: the ops, forward, backward, plan, private headers)."""
    long = {p.name: n for p in sorted((CSRC / "cuda").glob("*.cu*")) if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_kernel_utils_keep_no_checks():
    assert "TORCH_CHECK" not in (CSRC / "cpu" / "kernel_utils.h").read_text()


# Direct calls with one bad argument each -> the words their error must hold. Run in a child process: a crash
# while the extension formats its message fails this test instead of ending the test run.
_DIRECT_CALLS = textwrap.dedent(
    """
    import json, sys, torch
    import cat_fast  # noqa: F401  (loads the ops)

    ops = torch.ops.cat_fast
    z, y = torch.randn(3, 2), torch.tensor([0, 1, 1])
    h, lam = torch.randn(3, 2, 4), torch.rand(3)
    calls = {
        "crm_loss_forward: cf_logits: expected shape [3, 2] (the shape of logits)":
            lambda: ops.crm_loss_forward(z, torch.randn(3, 3), y, 0.1, 0.9, 1, False, -100),
        "cal_objective_forward: labels: expected dtype Long":
            lambda: ops.cal_objective_forward(z, y.int(), 1.0, 1.0, -100),
        "cal_objective_backward: grad: expected shape [3]":
            lambda: ops.cal_objective_backward(torch.ones(2), z, y, 1.0, 1.0, -100),
        "cmix_forward: partner: expected values in [0, 3)":
            lambda: ops.cmix_forward(h, lam, torch.tensor([0, 5, 1])),
        "cmix_backward: grad: expected dtype Float (the dtype of h)":
            lambda: ops.cmix_backward(torch.randn(3, 2, 4).double(), h, lam, torch.tensor([0, 2, 1])),
        "gs_row_dots: y: expected shape [4, 3]": lambda: ops.gs_row_dots(torch.randn(4, 3), torch.randn(4, 2)),
        "gs_row_dots: y: expected a contiguous tensor":
            lambda: ops.gs_row_dots(torch.randn(4, 3), torch.randn(3, 4).t()),
        "cal_step_: lam: expected dtype float32 or float64":
            lambda: ops.cal_step_(torch.rand(3).half(), torch.rand(3).half(), 0.1, 2.0, 0.0, 1.0),
        "bias_loss_forward: aux (the gate): expected shape [3]":
            lambda: ops.bias_loss_forward(z, torch.randn(3, 2), y, torch.randn(2), 5, 1, 0.0, -100),
        "bias_loss_forward: kind: expected a variant in [0, 6], got 7":
            lambda: ops.bias_loss_forward(z, torch.randn(3, 2), y, torch.randn(0), 7, 1, 0.0, -100),
        "sample_characteristics_forward: class_weights: expected shape [2, 5]":
            lambda: ops.sample_characteristics_forward(z, y, torch.randn(3, 5), torch.randn(2, 4), torch.zeros(2, 3),
                                                       1e-8, -100),
    }
    for words, call in calls.items():
        try:
            call()
            got = "no error"
        except RuntimeError as error:
            got = str(error).splitlines()[0]
        print(json.dumps([words, got]), flush=True)
    """
)


def test_direct_calls_name_the_argument():
    if not registry.cpp_loaded():
        pytest.skip("cat_fast._C is not built")
    done = subprocess.run([sys.executable, "-c", _DIRECT_CALLS], capture_output=True, text=True, timeout=300)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    assert done.returncode == 0, f"exit {done.returncode} after {len(results)} calls: {done.stderr[-600:]}"
    assert len(results) == 11
    for words, got in results:
        assert words in got, (words, got)


@pytest.mark.parametrize("call, words", [
    (lambda: cat_fast.ops.crm_loss(torch.randn(3, 2), torch.randn(3, 3), torch.tensor([0, 1, 1])),
     "cf_logits: expected shape"),
    (lambda: cat_fast.ops.cmix(torch.randn(3, 2, 4), torch.rand(3), torch.tensor([0, 5, 1])),
     "partner: expected values in [0, 3)"),
])
def test_the_python_wrappers_say_the_same_first(call, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        call()
