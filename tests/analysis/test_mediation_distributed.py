"""The mediation sweep split over 2 processes (gloo, CPU) equals the one-process sweep, table for table."""
import pytest
import torch
import torch.distributed as dist

from cat_fast import models
from cat_fast.analysis import mediation as M
from tests.conftest import tiny_batch, tiny_model
from tests.ranks import spawn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _setup():
    torch.manual_seed(0)
    model = tiny_model("bert", dtype=torch.float64).eval()
    b = tiny_batch("bert", batch=6, length=9, seed=1)
    samples = {k: v for k, v in b.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    zbar = M.treatment_means(model, {k: v[:3] for k, v in samples.items()})
    g = torch.Generator().manual_seed(2)
    zbar = {k: v + 5 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in zbar.items()}  # far means
    return model, samples, zbar


def _worker(rank, out):
    model, samples, zbar = _setup()
    effects = M.neuron_effects(model, samples, zbar, target_class=1, max_tokens=150, distributed=True)
    torch.save({"effects": effects.effects, "n": effects.n_samples}, f"{out}.{rank}")


def test_two_processes_equal_one(tmp_path):
    out = str(tmp_path / "effects")
    spawn(_worker, out, tmp_path=tmp_path)
    model, samples, zbar = _setup()
    one = M.neuron_effects(model, samples, zbar, target_class=1, max_tokens=150)
    keys = {(layer, c) for layer in (1, 2, 3) for c in models.COMPONENTS}
    for rank in range(2):
        got = torch.load(f"{out}.{rank}", weights_only=False)
        assert set(got["effects"]) == set(one.effects) == keys and got["n"] == one.n_samples
        for key, want in one.effects.items():
            assert want.abs().max() > 1e-7  # the interventions do something
            torch.testing.assert_close(got["effects"][key], want, rtol=0, atol=0)  # the same arithmetic


def test_split_keys_balances_and_covers():
    model = tiny_model("bert")
    keys = [(layer, c) for layer in (1, 2, 3) for c in models.COMPONENTS]
    widths = {k: (64 if k[1] == "intermediate" else 32) for k in keys}
    parts = M.split_keys(model, keys, widths, 2)
    assert sorted(k for p in parts for k in p) == sorted(keys) and all(parts)
    cost = [sum(widths[k] * (4 - k[0]) for k in p) for p in parts]
    assert max(cost) / min(cost) < 1.1  # within 10 % of each other
    assert M.split_keys(model, keys, widths, 2) == parts  # deterministic
    assert M.split_keys(model, keys, widths, 1) == [sorted(keys, key=lambda k: (-widths[k] * (4 - k[0]), k))]


def test_without_a_process_group_is_a_clear_error():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    model, samples, zbar = _setup()
    with pytest.raises(ValueError, match="distributed=True: no default process group"):
        M.neuron_effects(model, samples, zbar, distributed=True)
