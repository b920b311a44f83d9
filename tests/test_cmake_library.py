"""The CMake-built library (scripts/build_cmake.sh -> build-cmake/libcat_fast_ops.so) loads with
torch.ops.load_library and its ops are callable and correct.

Builds nothing: set CAT_FAST_CMAKE_LIB to the library's path. The checks run in a fresh Python
process, because the library and the cat_fast._C extension both define the `cat_fast` op namespace
and cannot be loaded into the same process.
"""
import os
import subprocess
import sys
import textwrap

import pytest

LIB = os.environ.get("CAT_FAST_CMAKE_LIB")

pytestmark = pytest.mark.skipif(
    not LIB,
    reason="CAT_FAST_CMAKE_LIB is not set (build with scripts/build_cmake.sh and point it at build-cmake/libcat_fast_ops.so)",
)

_CHECKS = textwrap.dedent(
    """
    import sys
    import torch

    torch.ops.load_library(sys.argv[1])
    ops = torch.ops.cat_fast
    torch.manual_seed(0)

    def close(a, b, tol):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)

    for dt, acc, tol in [(torch.float64, torch.float64, 1e-10), (torch.float32, torch.float32, 1e-5),
                         (torch.bfloat16, torch.float32, 2e-2)]:
        # cmix, per-sample and per-token lam, partner with repeats
        B, T, D = 3, 4, 5
        partner = torch.tensor([0, 0, 2])
        h = torch.randn(B, T, D, dtype=dt)
        for lam in (torch.rand(B, dtype=acc), torch.rand(B, T, dtype=acc)):
            lt = (lam if lam.dim() == 2 else lam[:, None].expand(B, T))[..., None]
            ha = h.to(acc)
            close(ops.cmix_forward(h, lam, partner), (lt * ha[partner] + (1 - lt) * ha).to(dt), tol)
            g = torch.randn(B, T, D, dtype=dt)
            gh, gl = ops.cmix_backward(g, h, lam, partner)
            ga = g.to(acc)
            close(gh, ((1 - lt) * ga).index_add(0, partner, lt * ga).to(dt), tol)
            close(gl, ((ha[partner] - ha) * ga).sum(-1), tol)

        # cal_objective
        z = torch.randn(5, 7, dtype=dt)
        y = torch.randint(0, 7, (5,))
        za = z.to(acc)
        want = 0.7 * (torch.logsumexp(za, 1) - za.gather(1, y[:, None])[:, 0]) + 1.3 * za.softmax(1).amax(1)
        close(ops.cal_objective_forward(z, y, 0.7, 1.3), want, tol)
        assert ops.cal_objective_backward(torch.ones(5, dtype=acc), z, y, 0.7, 1.3).shape == (5, 7)

        # crm_loss (mean)
        zc = torch.randn(5, 7, dtype=dt)
        loss, stats = ops.crm_loss_forward(z, zc, y, 0.5, 1.5, 1, True)
        assert loss.shape == () and stats.shape == (5, 4) and loss.dtype == acc
        close(loss, (stats[:, 0] * stats[:, 1]).mean(), tol)
        gz, gzc = ops.crm_loss_backward(torch.ones((), dtype=acc), z, zc, y, stats, 0.5, 1.5, 1, True)
        assert gz.shape == (5, 7) and gz.dtype == dt and bool((gzc == 0).all())

        # gs primitives
        x, v = torch.randn(4, 9, dtype=dt), torch.randn(4, 9, dtype=dt)
        xa, va = x.to(acc), v.to(acc)
        close(ops.gs_row_dots(x, v), torch.stack([(xa * va).sum(1), (xa * xa).sum(1), (va * va).sum(1)], 1), tol)
        coef = torch.randn(4, 4, dtype=acc)
        u, w = ops.gs_row_combine(x, v, coef)
        close(u, (coef[:, :1] * xa + coef[:, 1:2] * va).to(dt), tol)
        close(w, (coef[:, 2:3] * xa + coef[:, 3:] * va).to(dt), tol)

    # cal_step_ mutates lam in place
    lam = torch.randn(3, 4)
    lam[0] = 0
    g = torch.randn(3, 4)
    n = lam.norm(dim=1, keepdim=True)
    want = (lam + 0.1 * (g - torch.where(n == 0, torch.zeros_like(lam), lam / n))).clamp(-1.0, 1.0)
    ops.cal_step_(lam, g, 0.1, 2.0, -1.0, 1.0)
    close(lam, want, 1e-6)
    print("OK")
    """
)


def test_load_and_call_ops():
    assert os.path.isfile(LIB), f"CAT_FAST_CMAKE_LIB={LIB!r} is not a file"
    proc = subprocess.run([sys.executable, "-c", _CHECKS, LIB], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
