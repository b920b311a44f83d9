"""Datasets by hub name (``--train imdb``, ``ORG/NAME:CONFIG``, ``glue/sst2``, ``NAME@SPLIT``), read offline from the
local Hugging Face ``datasets`` cache: nothing downloads. The cache is written here the way ``datasets`` lays out a
hub dataset it has loaded once (``NAMESPACE___NAME/CONFIG/VERSION/HASH``)."""
import glob
import json
import os
import shutil

import pytest

from cat_fast.data import DataError, load_table
from tests.cli.conftest import run
from tests.cli.test_columns_by_convention import examples, one_line_error, train_args, write_jsonl

datasets = pytest.importorskip("datasets")


def cache_hub_dataset(cache, repo, config, splits, tmp_path):
    """Write `splits` (name -> rows) into `cache` as datasets' offline cache of hub dataset `repo` / `config`."""
    from datasets.packaged_modules.json.json import Json

    files = {name: write_jsonl(tmp_path / f"{repo.replace('/', '_')}-{config}-{name}.jsonl", rows)
             for name, rows in splits.items()}
    name = repo.split("/")[-1]
    build = tmp_path / "build"
    Json(data_files=files, dataset_name=name, config_name=config, cache_dir=str(build)).download_and_prepare()
    built = glob.glob(str(build / name / f"{config}-*" / "*"))
    built = [b for b in built if os.path.isdir(b)]
    assert len(built) == 1, built
    target = os.path.join(cache, "___".join(repo.split("/")), config, "0.0.0", "0123abcd")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.move(built[0], target)
    shutil.rmtree(build)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = str(tmp_path / "hf_datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    cache_hub_dataset(cache, "toy_reviews", "default", {"train": examples(24), "test": examples(10, seed=1)},
                      tmp_path)
    cache_hub_dataset(cache, "nyu-mll/glue", "sst2", {"train": examples(20, seed=2),
                                                      "validation": examples(8, seed=3)}, tmp_path)
    cache_hub_dataset(cache, "glue", "sst2", {"train": examples(12, seed=4)}, tmp_path)
    return cache


def test_load_table_reads_a_cached_hub_dataset_by_name(hub_cache):
    assert len(load_table("toy_reviews").labels) == 24
    assert len(load_table("toy_reviews", split="test").labels) == 10
    assert len(load_table("nyu-mll/glue:sst2", split="validation").labels) == 8
    assert len(load_table("glue/sst2").labels) == 12  # no ORG "glue" with NAME "sst2": NAME "glue", CONFIG "sst2"


def test_a_name_that_is_not_cached_says_so_without_downloading(hub_cache):
    with pytest.raises(DataError, match=r"imdb: not a file or folder, and not a dataset in the local Hugging Face "
                                        r"cache .*nothing is downloaded"):
        load_table("imdb")
    with pytest.raises(DataError, match="sst3|config"):
        load_table("nyu-mll/glue:sst3")


def test_train_dev_and_eval_take_hub_names(tiny, tmp_path, capsys, hub_cache):
    out = tmp_path / "o"
    code, err = run(train_args(tiny, "toy_reviews", out, "--dev", "toy_reviews@test", "--eval",
                               "sst2=nyu-mll/glue:sst2@validation", "--no-checkpoint"), capsys)
    assert code == 0, err
    m = json.loads((out / "metrics.json").read_text())
    assert m["data"]["n_train"] == 24 and m["eval"]["dev"]["n"] == 10 and m["eval"]["sst2"]["n"] == 8
    err = one_line_error(*run(train_args(tiny, "not_cached_here", tmp_path / "p"), capsys), tmp_path / "p")
    assert "not_cached_here: not a file or folder" in err
