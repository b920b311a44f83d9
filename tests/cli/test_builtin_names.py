"""The shipped CAD data by name (``cad:TASK/SPLIT[/KIND]``) wherever the CLI takes a data path, from any directory."""
import pytest

from cat_fast import data as D
from cat_fast.cli.common import CliError
from cat_fast.cli.sources import Source, builtin_files

from .conftest import run

HYPOTHESIS = {"text_column": "sentence2", "label_column": "gold_label"}
NLI_LABELS = ("entailment", "neutral", "contradiction")


def test_names_give_the_shipped_files():
    assert builtin_files("cad:nli/train") == ("nli", D.builtin_train_files("nli", "train"))
    assert builtin_files("cad:sentiment/dev") == ("sentiment", [D.builtin_path("sentiment", "dev", "paired")])
    assert builtin_files("cad:nli/train/original") == ("nli", [D.builtin_path("nli", "train", "original")])


@pytest.mark.parametrize("name", ["cad:nli", "cad:nli/test", "cad:sst/train", "cad:nli/dev/nope", "cad:nli/dev/a/b"])
def test_a_bad_name_says_the_forms(name):
    with pytest.raises(CliError, match=f"^{name}: .*(cad:TASK/SPLIT|kinds: )"):  # the forms, or the kinds
        builtin_files(name)


def test_names_read_with_a_task_and_as_own_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repository: the names find the files through the package
    nli = Source("nli", {}, None)
    assert len(nli.read_train(["cad:nli/train"])) == len(D.load_builtin("nli", "train"))
    assert len(nli.read("cad:nli/dev")) == len(D.load_builtin("nli", "dev"))
    assert len(nli.read("cad:nli/dev/original")) == len(D.load_eval("nli", D.builtin_path("nli", "dev", "original")))
    with pytest.raises(CliError, match="^cad:sentiment/dev: sentiment data, but this run's --task is nli"):
        nli.read("cad:sentiment/dev")
    own = Source(None, HYPOTHESIS, NLI_LABELS)
    hypotheses = own.read_train(["cad:nli/train/original"])
    assert hypotheses.text[0] == D.load_builtin("nli", "train").text_pair[0]
    with pytest.raises(CliError, match="^cad:nli/train: 3 files, .* e.g. cad:nli/train/original"):
        own.read_train(["cad:nli/train"])


def test_cli_takes_a_name_and_refuses_a_bad_one(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run(["bias", "fit", "--kind", "overlap", "--task", "nli", "--train", "cad:nli/dev/original",
                     "--out", tmp_path / "bias"], capsys)
    assert code == 0, err
    code, err = run(["bias", "fit", "--kind", "overlap", "--task", "nli", "--train", "cad:nli/tran",
                     "--out", tmp_path / "bad"], capsys)
    assert code == 2 and "cat-fast: error: cad:nli/tran: expected a shipped data name" in err
    assert not (tmp_path / "bad").exists()
