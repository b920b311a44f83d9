"""Fixtures of the layer tests."""
import pytest

from cat_fast.layers import packing


@pytest.fixture
def pack_calls(monkeypatch):
    """Each `packing.pack` / `packing.unpack` call: "pack" or "unpack"."""
    calls = []
    for name in ("pack", "unpack"):
        original = getattr(packing, name)
        monkeypatch.setattr(packing, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    return calls
