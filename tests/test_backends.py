import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cat_fast
from cat_fast.ops import registry as _registry

ROOT = Path(__file__).resolve().parents[1]


def test_reference_and_cpp_are_available_on_cpu():
    assert "reference" in cat_fast.backends()
    assert "cpp" in cat_fast.backends(), _registry.load_errors()


def test_python_schemas_match_the_cpp_schemas():
    # Each op's schema lives beside its CPU kernel (csrc/cpu/<op>.cpp); csrc/ops.cpp defines the namespace.
    cpp_files = [ROOT / "csrc" / "ops.cpp", *sorted((ROOT / "csrc" / "cpu").glob("*.cpp"))]
    source = "\n".join(path.read_text() for path in cpp_files)
    declared = dict(re.findall(r'm\.def\("(\w+)(\(.*?\) -> .*?)"\);', source))
    assert declared == _registry.SCHEMAS
    for name, schema in _registry.SCHEMAS.items():
        assert str(getattr(torch.ops.cat_fast, name).default._schema) == f"cat_fast::{name}{schema}"


def test_use_backend_selects_and_restores():
    h, lam, partner = torch.randn(2, 3, 4), torch.rand(2), torch.tensor([1, 0])
    assert cat_fast.ops.backend.select("cmix", h.device) == "cpp"
    with cat_fast.use_backend("reference"):
        assert cat_fast.ops.backend.select("cmix", h.device) == "reference"
        cat_fast.ops.cmix(h, lam, partner)
    assert cat_fast.ops.backend.select("cmix", h.device) == "cpp"


def test_unknown_or_unavailable_backend_is_a_clear_error():
    with pytest.raises(ValueError, match=r"backend: expected one of"):
        with cat_fast.use_backend("fortran"):
            pass
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="backend 'cuda' is not available here"):
            with cat_fast.use_backend("cuda"):
                pass


def test_backend_that_cannot_run_on_the_device():
    if "triton" not in cat_fast.backends() and not torch.cuda.is_available():
        with cat_fast.use_backend("cpp"):
            with pytest.raises(ValueError, match="cannot run"):
                cat_fast.ops.backend.select("cmix", torch.device("cuda"))


def test_environment_variable_picks_the_backend():
    code = "import cat_fast, torch; print(cat_fast.ops.backend.select('cmix', torch.device('cpu')))"
    env = dict(os.environ, CAT_FAST_BACKEND="reference")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "reference"


def test_import_without_triton_or_extension_still_works():
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['cat_fast._C'] = None\n"
        "import cat_fast, torch\n"
        "print(cat_fast.backends())\n"
        "print(cat_fast.ops.cmix(torch.randn(2, 3, 4), torch.rand(2), torch.tensor([1, 0]))[0].shape)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["('reference',)", "torch.Size([2, 3, 4])"]


def test_loss_kernel_schemas_take_ignore_index_last_with_its_default():
    """cal_objective_* and crm_loss_* take `int ignore_index=-100` last: the kernels skip those rows themselves,
    and callers of the earlier schemas (LibTorch, the CMake library's users) keep working."""
    for name in ("cal_objective_forward", "cal_objective_backward", "crm_loss_forward", "crm_loss_backward"):
        assert _registry.SCHEMAS[name].split(") -> ")[0].endswith(", int ignore_index=-100"), name
