"""`cat-fast shortcut plant` end to end: the files it writes, a tiny `cat-fast train` on them scoring the anti and
clean test sets, --overwrite, and every bad input as one line with exit 2 and nothing written."""
import json
import re

import pytest

from cat_fast.shortcuts import FILLER
from tests.cli.conftest import run

WORDS = ("good", "great", "fine", "bad", "awful", "poor", "ok", "plain", "movie", "film", "plot", "actor")
SPLITS = ("train", "train_clean", "dev", "test_anti", "test_clean")


def reviews(path, n=40):
    """A CSV of n reviews (columns review, label: pos / neg alternating), each ending in '.' or '!'."""
    lines = ["review,label"]
    for i in range(n):
        words = " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(5))
        lines.append(f"{words}{'!' if i % 3 else '.'},{'pos' if i % 2 else 'neg'}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def plant(src, out, *extra):
    return ["shortcut", "plant", "--train", src, "--cue", "punctuation", "--strength", 0.8, "--dev-fraction", 0.25,
            "--test-fraction", 0.25, "--seed", 1, "--out", out, *extra]


def read(path):
    return [json.loads(line) for line in open(path)]


def test_plant_then_train_scores_anti_and_clean(tiny, tmp_path, capsys):
    src, out = reviews(tmp_path / "reviews.csv"), tmp_path / "planted"
    code, err = run(plant(src, out, "--cue-class", "pos"), capsys)
    assert code == 0, err
    assert "cat-fast: wrote" in err and (out / ".cat-fast").is_file()
    meta = json.loads((out / "shortcut.json").read_text())
    assert (meta["cue"], meta["cue_class"], meta["labels"], meta["strength"]) == ("punctuation", "pos",
                                                                                   ["neg", "pos"], 0.8)
    rows = {name: read(out / f"{name}.jsonl") for name in SPLITS}
    assert [len(rows[s]) for s in SPLITS] == [20, 20, 10, 10, 10]
    for name, split in rows.items():
        assert all(set(r) == {"id", "text", "label", "cue"} for r in split)
        assert all(r["text"].endswith("!!" if r["cue"] else ".") and not r["text"].endswith("!.") for r in split)
        stats = meta["splits"][name]["labels"]
        assert stats["pos"]["cue"] == sum(r["cue"] for r in split if r["label"] == "pos")
    assert all(r["cue"] == (r["label"] == "neg") for r in rows["test_anti"])
    train = rows["train"]
    n_pos = sum(r["label"] == "pos" for r in train)
    assert sum(r["cue"] for r in train if r["label"] == "pos") == int(0.8 * n_pos + 0.5)
    code, err = run(plant(src, tmp_path / "again", "--cue-class", "pos"), capsys)
    assert code == 0 and all((tmp_path / "again" / f"{s}.jsonl").read_text() == (out / f"{s}.jsonl").read_text()
                             for s in SPLITS)

    d = str(out)
    code, err = run(["train", "--method", "erm", "--train", f"{d}/train.jsonl", "--dev", f"{d}/dev.jsonl",
                     "--eval", f"anti={d}/test_anti.jsonl", f"clean={d}/test_clean.jsonl", "--text-column", "text",
                     "--label-column", "label", "--id-column", "id", "--labels", "neg,pos", "--model", tiny,
                     "--epochs", 1, "--batch-size", 8, "--max-length", 16, "--device", "cpu", "--no-checkpoint",
                     "--out", tmp_path / "run"], capsys)
    assert code == 0, err
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert {k: v["n"] for k, v in metrics["eval"].items()} == {"dev": 10, "anti": 10, "clean": 10}


def test_overwrite_convention(tmp_path, capsys):
    src, out = reviews(tmp_path / "reviews.csv"), tmp_path / "planted"
    assert run(plant(src, out), capsys)[0] == 0
    code, err = run(plant(src, out, "--cue", "length"), capsys)
    assert code == 2 and "pass --overwrite to replace it" in err
    assert json.loads((out / "shortcut.json").read_text())["cue"] == "punctuation"
    assert run(plant(src, out, "--cue", "length", "--overwrite"), capsys)[0] == 0
    assert json.loads((out / "shortcut.json").read_text())["cue"] == "length:3"


def test_an_end_of_text_cue_beyond_the_truncation_length_is_said(tmp_path, capsys):
    """Punctuation ends each text: with --no-fit-max-length at --max-length 4 (fewer tokens than any planted text)
    every training row with the cue loses it, which is said and counted, the texts whole; at 64 nothing; a cue at the
    start is not checked."""
    src = reviews(tmp_path / "reviews.csv")
    code, err = run(plant(src, tmp_path / "short", "--max-length", 4, "--no-fit-max-length"), capsys)
    meta = json.loads((tmp_path / "short" / "shortcut.json").read_text())
    beyond = meta["beyond_max_length"]
    assert code == 0 and "sits at the end of the text" in err and "--max-length 4 tokens" in err, err
    assert beyond["max_length"] == 4 and beyond["longer"] == beyond["rows_with_cue"] > 0
    assert meta["fit_max_length"] is None and "cut to fit" not in err and "plant with --fit-max-length" in err
    assert all(len(r["text"].split()) == 5 for r in read(tmp_path / "short" / "train.jsonl"))
    code, err = run(plant(src, tmp_path / "long", "--max-length", 64), capsys)
    beyond = json.loads((tmp_path / "long" / "shortcut.json").read_text())["beyond_max_length"]
    assert code == 0 and "sits at the end" not in err and beyond["longer"] == 0 and beyond["rows_with_cue"] > 0
    code, err = run(plant(src, tmp_path / "start", "--max-length", 4, "--cue", "token:zeugma@start"), capsys)
    assert code == 0 and "sits at the end" not in err
    assert json.loads((tmp_path / "start" / "shortcut.json").read_text())["beyond_max_length"] is None


def long_reviews(path):
    """A CSV of 40 reviews (columns review, label): every fourth row 3 words, the others 30 to 60 words of several
    tokens each ("well-made," is four), some ending in '!' or without an ending."""
    words = WORDS + ("well-made,", "unbelievably", "(mostly)", "cinematography.")
    lines = ["review,label"]
    for i in range(40):
        n = 3 if i % 4 == 0 else 30 + i
        text = " ".join(words[(i * 5 + k * 7) % len(words)] for k in range(n)) + ("!" if i % 3 else "")
        lines.append(f'"{text}",{"pos" if i % 2 else "neg"}')
    path.write_text("\n".join(lines) + "\n")
    return str(path), [line.rsplit(",", 1)[0].strip('"') for line in lines[1:]]


def bare(cue, text):
    """The planted text without the cue's ending."""
    return text[:-2] if cue == "punctuation" and text.endswith("!!") else (
        text[:-1] if cue == "punctuation" else text.split(" " + FILLER)[0])


@pytest.mark.parametrize("cue", ["punctuation", "length:2"])
def test_an_end_of_text_cue_is_fitted_into_the_truncation_length(tmp_path, capsys, cue):
    """At --max-length 32, every row of every split, as MiniLM's tokenizer reads it, fits with the cue: its text a
    prefix of the input row's ending at a word's end, the same in train, train_clean and the test sets; short rows
    whole; shortcut.json counts the cut rows and no longer row."""
    from cat_fast.models.pretrained import load_tokenizer

    tokenizer = load_tokenizer("minilm")
    (src, original), out = long_reviews(tmp_path / "long.csv"), tmp_path / "fitted"
    code, err = run(plant(src, out, "--cue", cue, "--max-length", 32), capsys)
    assert code == 0 and "sits at the end" not in err and "30 input rows cut to fit --max-length 32" in err, err
    meta = json.loads((out / "shortcut.json").read_text())
    assert meta["fit_max_length"]["inputs"]["train"]["rows_cut"] == meta["fit_max_length"]["rows_cut"] == 30
    assert meta["fit_max_length"]["unfit"] == 0 and meta["beyond_max_length"]["longer"] == 0
    rows = {name: {r["id"]: r for r in read(out / f"{name}.jsonl")} for name in SPLITS}
    for name, split in rows.items():
        for i, r in split.items():
            assert len(tokenizer(r["text"])["input_ids"]) <= 32, (name, r)
            kept = bare(cue, r["text"])
            assert r["text"] == kept + ("!!" if r["cue"] else ".") if cue == "punctuation" else (
                r["text"] == kept + (" " + " ".join([FILLER] * 2) if r["cue"] else ""))
            source = original[int(i)]
            whole = source.rstrip("!.") if cue == "punctuation" else source  # punctuation replaces the ending
            end = r"[.!]*( |$)" if cue == "punctuation" else r"( |$)"  # at a word's end (less the replaced ending)
            assert source.startswith(kept) and re.match(end, source[len(kept):]), (source, r)
            if int(i) % 4 == 0:
                assert kept == whole
    for i, r in rows["train"].items():
        assert bare(cue, rows["train_clean"][i]["text"]) == bare(cue, r["text"])
    for i, r in rows["test_anti"].items():
        assert bare(cue, rows["test_clean"][i]["text"]) == bare(cue, r["text"])
    assert sum(len(bare(cue, r["text"]).split()) < len(original[int(i)].split()) for i, r in rows["train"].items()) > 10


def test_a_row_that_cannot_fit_keeps_one_word_and_is_said(tmp_path, capsys):
    src = reviews(tmp_path / "reviews.csv")
    code, err = run(plant(src, tmp_path / "tiny", "--max-length", 4), capsys)
    meta = json.loads((tmp_path / "tiny" / "shortcut.json").read_text())
    assert code == 0 and "--fit-max-length: 40 input rows do not fit in --max-length 4 tokens" in err, err
    assert meta["fit_max_length"]["unfit"] == 40 and meta["beyond_max_length"]["longer"] > 0
    assert all(len(r["text"].split()) == 1 for r in read(tmp_path / "tiny" / "train.jsonl"))


@pytest.mark.parametrize("extra, message", [
    (["--strength", "0.45"], "argument --strength: expected a number in [0.5, 1], got '0.45'"),
    (["--strength", "1.5"], "argument --strength: expected a number in [0.5, 1], got '1.5'"),
    (["--cue", "emoji"], "argument --cue: expected token:WORD[@start|@end|@random], length[:N], punctuation or "
                         "casing[:K], got 'emoji'"),
    (["--cue", "token:film"], "--cue: the cue token 'film' is already in "),
    (["--cue-class", "meh"], "--cue-class 'meh' is not a label of the data (labels: neg, pos)"),
    (["--cue-field", "text_pair"], "--cue-field text_pair needs text pairs"),
    (["--test", "EMPTY"], "empty.csv: no data rows"),  # the reader's refusal
    (["--dev", "NEG"], "--dev: the dev split's 3 rows are all of the cue class 'neg'"),
    (["--test-fraction", "0.6", "--dev-fraction", "0.5"], "--train: the train split is empty"),
    (["--test-fraction", "1"], "argument --test-fraction: expected a number in (0, 1), got '1'"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, extra, message):
    src = reviews(tmp_path / "reviews.csv")
    (tmp_path / "empty.csv").write_text("review,label\n")
    (tmp_path / "neg.csv").write_text("review,label\na b.,neg\nc d.,neg\ne f.,neg\n")
    extra = [{"EMPTY": str(tmp_path / "empty.csv"), "NEG": str(tmp_path / "neg.csv")}.get(x, x) for x in extra]
    code, err = run(plant(src, tmp_path / "out", *extra), capsys)
    errors = [line for line in err.splitlines() if not line.startswith("cat-fast: columns: ")]  # found by name
    assert code == 2 and len(errors) == 1 and errors[0].startswith("cat-fast: error: ") and message in err, err
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.csv", "neg.csv", "reviews.csv"]
