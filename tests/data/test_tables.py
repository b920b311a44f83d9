"""cat_fast.data.load_table (users' own files), CadData with its own TaskSpec, group_batches; real files in tmp_path."""
import csv
import json
import os

import pytest
import torch

from cat_fast import data as D


def write_csv(path, rows, bom=False):
    with open(path, "w", newline="", encoding="utf-8-sig" if bom else "utf-8") as f:
        csv.writer(f).writerows(rows)
    return str(path)


def write_tsv(path, rows, bom=False):
    path.write_text("".join("\t".join(map(str, r)) + "\n" for r in rows), encoding="utf-8-sig" if bom else "utf-8")
    return str(path)


def write_jsonl(path, objs):
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs), encoding="utf-8")
    return str(path)


def error(fn, *args, **kw) -> str:
    """The DataError's message; it must be one line."""
    with pytest.raises(D.DataError) as e:
        fn(*args, **kw)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import BertTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "good", "bad", "film", "movie", "cat", "sat", ",", "."]
    vocab = tmp_path_factory.mktemp("tok") / "vocab.txt"
    vocab.write_text("\n".join(words) + "\n")
    return BertTokenizerFast(vocab=str(vocab))


# ------------------------------------------------------------------ formats


def test_csv_quoting_bom_and_string_labels(tmp_path):
    p = write_csv(tmp_path / "r.csv", [["Sentiment", "Text"], ["pos", "good, really good"], ["neg", 'bad "film"\nnext line'],
                                       ["neutral", "NA"], ["neg", "a  <br />b"]], bom=True)
    d = D.load_table(p, text_column="Text", label_column="Sentiment")
    assert d.text == ["good, really good", 'bad "film"\nnext line', "NA", "a b"]
    assert d.label_names == ("neg", "neutral", "pos")  # alphabetical
    assert d.labels == [2, 0, 1, 0] and d.num_labels == 3
    # line numbers count the header as line 1 and follow quoted newlines
    assert d.sources == [f"{p}:2", f"{p}:3", f"{p}:5", f"{p}:6"]
    assert d.ids == ["0", "1", "2", "3"] and d.skipped == 0 and d.skipped_where == []
    assert d.is_orig == [True] * 4 and not d.has_pairs and d.choose_partners(0) == [-1] * 4
    assert d.task == "custom" and d.spec.text_columns == ("Text",) and d.spec.label_column == "Sentiment"
    assert d.class_counts() == {"neg": 2, "neutral": 1, "pos": 1}
    raw = D.load_table(p, text_column="Text", label_column="Sentiment", clean_text=False)
    assert raw.text[3] == "a  <br />b"


def test_tsv_no_quoting_bom_and_integer_labels(tmp_path):
    p = write_tsv(tmp_path / "r.tsv", [["label", "text"], [10, '"quoted ""x"" text'], [2, "NA"], [0, "x"], [2, "y"]], bom=True)
    d = D.load_table(p, text_column="text", label_column="label")
    assert d.text == ['"quoted ""x"" text', "NA", "x", "y"]
    assert d.label_names == ("0", "2", "10")  # numeric order, not "0", "10", "2"
    assert d.labels == [2, 1, 0, 1]
    for ext in (".tab", ".txt"):
        q = tmp_path / ("r" + ext)
        q.write_bytes(open(p, "rb").read())
        assert D.load_table(str(q), text_column="text", label_column="label").text == d.text


def test_read_tsv_accepts_bom(tmp_path):
    p = write_tsv(tmp_path / "bom.tsv", [["Sentiment", "Text"], ["Positive", "good"]], bom=True)
    assert D.read_tsv(p, ["Sentiment", "Text"]) == {"Sentiment": ["Positive"], "Text": ["good"]}
    assert D.load_train("sentiment", [p]).labels == [1]


def test_jsonl_int_labels_pairs_and_ids(tmp_path):
    p = write_jsonl(tmp_path / "nli.jsonl", [
        {"premise": "a cat sat", "hypothesis": "a cat", "label": 0, "uid": "e1"},
        {"premise": "a cat sat", "hypothesis": "no cat", "label": 2, "uid": "e2"},
        "",  # a blank line is not a row
        {"premise": "a film", "hypothesis": "a movie", "label": 1, "uid": 17},
    ])
    d = D.load_table(p, text_column="premise", text_pair_column="hypothesis", label_column="label", id_column="uid")
    assert d.text == ["a cat sat", "a cat sat", "a film"] and d.text_pair == ["a cat", "no cat", "a movie"]
    assert d.label_names == ("0", "1", "2") and d.labels == [0, 2, 1]
    assert d.ids == ["e1", "e2", "17"]
    assert d.sources == [f"{p}:1", f"{p}:2", f"{p}:4"]
    assert d.spec.text_columns == ("premise", "hypothesis")
    q = tmp_path / "nli.json"
    q.write_text(open(p).read())
    assert D.load_table(str(q), text_column="premise", text_pair_column="hypothesis", label_column="label").labels == d.labels


def test_save_to_disk_dataset_and_datasetdict(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"sentence": ["good film", "bad film", "NA", "   "], "label": [1, 0, 1, 0], "pair": [7, 7, 8, 8]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    d = D.load_table(str(tmp_path / "ds"), text_column="sentence", label_column="label", group_column="pair")
    assert d.text == ["good film", "bad film", "NA"] and d.labels == [1, 0, 1] and d.label_names == ("0", "1")
    assert d.groups == [[0, 1], [2]] and d.partners == [[1], [0], []]
    assert d.skipped == 1 and d.skipped_where == [f"{tmp_path / 'ds'}:3"] and d.ids == ["0", "1", "2"]
    # a ClassLabel column keeps its names and their order
    feats = datasets.Features({"sentence": datasets.Value("string"), "label": datasets.ClassLabel(names=["pos", "neg"]),
                               "pair": datasets.Value("int64")})
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict(rows, features=feats),
        "validation": datasets.Dataset.from_dict({k: v[:2] for k, v in rows.items()}, features=feats),
    })
    dd.save_to_disk(str(tmp_path / "dd"))
    d = D.load_table(str(tmp_path / "dd"), text_column="sentence", label_column="label")
    assert len(d) == 3 and d.label_names == ("pos", "neg") and d.labels == [1, 0, 1]
    v = D.load_table(str(tmp_path / "dd"), text_column="sentence", label_column="label", split="validation")
    assert len(v) == 2 and v.sources[0] == f"{tmp_path / 'dd'}[validation]:0"
    msg = error(D.load_table, str(tmp_path / "dd"), text_column="sentence", label_column="label", split="test")
    assert "no split 'test'" in msg and "train, validation" in msg
    msg = error(D.load_table, str(tmp_path / "ds"), text_column="sentence", label_column="label", split="train")
    assert "has no splits" in msg
    msg = error(D.load_table, str(tmp_path / "dd"), text_column="text", label_column="label")
    assert f"{tmp_path / 'dd'}[train]" in msg and "missing column(s) text" in msg and "found sentence, label, pair" in msg


def test_dataset_folder_of_files_via_load_dataset(tmp_path):
    pytest.importorskip("datasets")
    folder = tmp_path / "mydata"
    folder.mkdir()
    write_csv(folder / "train.csv", [["text", "label"], ["NA", "yes"], ["good film", "no"]])
    write_csv(folder / "test.csv", [["text", "label"], ["bad film", "no"]])
    d = D.load_table(str(folder), text_column="text", label_column="label")
    assert d.text == ["NA", "good film"] and d.label_names == ("no", "yes")  # "NA" stays text
    assert D.load_table(str(folder), text_column="text", label_column="label", split="test").text == ["bad film"]
    script = tmp_path / "scripted"
    script.mkdir()
    (script / "scripted.py").write_text("import datasets\n")
    msg = error(D.load_table, str(script), text_column="text", label_column="label")
    assert str(script) in msg and "load_dataset" in msg


# ------------------------------------------------------------------ rows, labels, groups, ids


def test_blank_rows_skipped_and_counted(tmp_path):
    rows = [["text", "hyp", "label"], ["a cat", "a film", "x"], ["", "b", "x"], ["a", "   ", "y"], [" \t", "c", "y"],
            ["good", "bad", "y"]]
    p = write_csv(tmp_path / "blank.csv", rows)
    d = D.load_table(p, text_column="text", text_pair_column="hyp", label_column="label")
    assert d.text == ["a cat", "good"] and d.skipped == 3
    assert d.skipped_where == [f"{p}:3", f"{p}:4", f"{p}:5"]
    assert d.ids == ["0", "4"]  # ids are row indices in the file, skipped rows counted
    assert "3 row(s) skipped for empty text" in d.describe()
    # only the text column: the blank pair text does not matter
    assert D.load_table(p, text_column="text", label_column="label").skipped == 2
    # few rows shown, all counted
    many = [["text", "label"]] + [["", "x"]] * 15 + [["ok", "x"]]
    d = D.load_table(write_csv(tmp_path / "many.csv", many), text_column="text", label_column="label")
    assert d.skipped == 15 and len(d.skipped_where) == 10 and ", ...)" in d.describe()


def test_labels_given_restrict_and_order(tmp_path):
    p = write_tsv(tmp_path / "l.tsv", [["y", "t"], ["pos", "good"], ["neg", "bad"], ["pos", "fine"]])
    d = D.load_table(p, text_column="t", label_column="y", labels=["pos", "neg", "mixed"])
    assert d.label_names == ("pos", "neg", "mixed") and d.labels == [0, 1, 0]
    assert d.class_counts() == {"pos": 2, "neg": 1, "mixed": 0}
    msg = error(D.load_table, p, text_column="t", label_column="y", labels=["pos"])
    assert msg.startswith(f"{p}: line 3: ") and "unknown label 'neg'" in msg and "allowed labels: pos" in msg
    # integer labels given as integers match the file's digits
    q = write_jsonl(tmp_path / "i.jsonl", [{"t": "a", "y": 1}, {"t": "b", "y": "0"}])
    assert D.load_table(q, text_column="t", label_column="y", labels=[1, 0]).labels == [0, 1]
    assert "given twice" in error(D.load_table, q, text_column="t", label_column="y", labels=[1, "1"])
    assert "sequence of label names" in error(D.load_table, q, text_column="t", label_column="y", labels="pos")


def test_groups_first_row_is_original_and_all_pairs_partner(tmp_path):
    rows = [["id", "g", "label", "text"],
            ["a", "g1", "entailment", "t0"], ["b", "g2", "neutral", "t1"], ["c", "g1", "contradiction", "t2"],
            ["d", "g1", "neutral", "t3"], ["e", "g1", "contradiction", "t4"], ["f", "", "neutral", "t5"],
            ["g", "g2", "neutral", "t6"]]
    p = write_csv(tmp_path / "g.csv", rows)
    d = D.load_table(p, text_column="text", label_column="label", group_column="g", id_column="id")
    assert d.is_orig == [True, True, False, False, False, True, False]
    assert d.groups == [[0, 2, 3, 4], [1, 6], [5]]
    # every two members of a group with different labels are partners (edits too), same labels are not
    assert d.partners == [[2, 3, 4], [], [0, 3], [0, 2, 4], [0, 3], [], []]
    assert d.has_pairs and d.n_orig == 3 and d.ids == list("abcdefg")
    for seed in (0, 1, 2):
        ch = d.choose_partners(seed)
        assert all(j == -1 if not d.partners[i] else j in d.partners[i] for i, j in enumerate(ch))
    assert d.choose_partners(5) == d.choose_partners(5)
    e = d.edits()
    assert len(e) == 4 and e.ids == ["c", "d", "e", "g"] and e.spec == d.spec and e.pairing == "all"
    o = d.originals()
    assert o.ids == ["a", "b", "f"] and not o.has_pairs


def test_subset_and_few_shot_on_custom_data(tmp_path):
    rows = [["g", "label", "text"]]
    for k in range(6):  # 6 groups: an original and two edits, labels cycling over three names
        labs = ["red", "green", "blue"]
        for j in range(3):
            rows.append([f"g{k}", labs[(k + j) % 3], f"text {k} {j}"])
    p = write_csv(tmp_path / "fs.csv", rows)
    d = D.load_table(p, text_column="text", label_column="label", group_column="g")
    assert d.label_names == ("blue", "green", "red") and d.class_counts(originals_only=True) == {"blue": 2, "green": 2, "red": 2}
    fs = D.few_shot(d, 1, seed=0)
    assert fs.class_counts(originals_only=True) == {"blue": 1, "green": 1, "red": 1}
    assert len(fs) == 9 and all(len(g) == 3 for g in fs.groups) and fs.label_names == d.label_names
    assert fs.ids == sorted(fs.ids, key=int) and set(fs.ids) <= set(d.ids)
    assert all(fs.text[i] == d.text[int(fs.ids[i])] for i in range(len(fs)))
    assert fs.pairing == "all" and all(len(fs.partners[i]) == 2 for i in range(len(fs)))
    assert D.few_shot(d, 1, seed=0).ids == fs.ids
    fo = D.few_shot(d, 2, seed=0, with_edits=False)
    assert len(fo) == 6 and not fo.has_pairs
    msg = error(D.few_shot, d, 3)
    assert "class 'blue'" in msg and "only 2 original" in msg and p in msg
    sub = d.subset([4, 3])
    assert sub.ids == ["4", "3"] and sub.text == [d.text[4], d.text[3]] and sub.spec is d.spec
    assert "custom: 2 examples" in sub.describe()


def test_cad_data_with_own_taskspec():
    spec = D.TaskSpec("topics", "topic", ("body",), ["sports", "politics", "science"])
    assert spec.labels == ("sports", "politics", "science") and spec.num_labels == 3
    d = D.CadData(spec, ["a", "b", "c", "d"], None, [0, 2, 1, 0], [True, False, False, True], [0, 0, 0, 1])
    assert d.task == "topics" and d.spec is spec and d.label_names == spec.labels
    assert d.partners == [[1, 2], [0], [0], []]  # the CAD pairing by default: edits do not pair with each other
    assert d.ids == ["0", "1", "2", "3"]
    a = D.CadData(spec, ["a", "b", "c"], None, [0, 2, 1], [True, False, False], [0, 0, 0], pairing="all")
    assert a.partners == [[1, 2], [0, 2], [0, 1]]
    assert D.CadData("topics", ["a"], None, [0], [True], [0], spec=spec).spec is spec
    assert D.CadData("sentiment", ["a"], None, [1], [True], [0]).label_names == ("Negative", "Positive")
    with pytest.raises(D.DataError, match="unknown task"):
        D.CadData("topics", ["a"], None, [0], [True], [0])
    with pytest.raises(D.DataError, match="label id 3 .* not in 0..2"):
        D.CadData(spec, ["a"], None, [3], [True], [0])
    with pytest.raises(D.DataError, match="duplicate label"):
        D.TaskSpec("x", "y", ("t",), ("a", "a"))
    with pytest.raises(D.DataError, match="unknown pairing"):
        D.CadData(spec, ["a"], None, [0], [True], [0], pairing="some")


# ------------------------------------------------------------------ tokenising, collating, batching


def test_tokenized_data_and_collator_on_custom_pairs(tmp_path, tokenizer):
    rows = [["g", "label", "premise", "hypothesis"],
            [1, "yes", "a cat sat", "a cat"], [1, "no", "a cat sat", "a film"], [1, "maybe", "a cat", "a movie ."],
            [2, "no", "good film", "bad film"], [2, "yes", "good film", "good movie"], [3, "yes", "a", "a"]]
    d = D.load_table(write_csv(tmp_path / "p.csv", rows), text_column="premise", text_pair_column="hypothesis",
                     label_column="label", group_column="g")
    assert d.label_names == ("maybe", "no", "yes")
    ds = D.TokenizedData(d, tokenizer, max_length=16)
    assert 1 in ds[0]["token_type_ids"] and ds[0]["labels"] == 2
    assert tokenizer.convert_ids_to_tokens(ds[0]["input_ids"]) == ["[CLS]", "a", "cat", "sat", "[SEP]", "a", "cat", "[SEP]"]
    collate = D.Collator(tokenizer, partner=d.choose_partners(0))
    for b in D.make_batches(d, batch_size=4, keep_groups=True, seed=0).batches(0):
        batch = collate([ds[i] for i in b])
        assert batch["labels"].tolist() == [d.labels[i] for i in b]
        for k, j in enumerate(batch["pairs"].tolist()):
            if d.partners[b[k]]:
                assert j >= 0 and d.group[b[j]] == d.group[b[k]] and batch["labels"][j] != batch["labels"][k]
            else:
                assert j == -1
    loader = torch.utils.data.DataLoader(ds, batch_sampler=D.make_batches(d, 4, keep_groups=True), collate_fn=collate)
    assert sum(len(b["labels"]) for b in loader) == len(d)


def test_group_batches_matches_sampler():
    ids = ["b", "a", "b", 3, "a", "c", 3, 3, "d", "b"]
    groups = {}
    for i, g in enumerate(ids):
        groups.setdefault(g, []).append(i)
    s = D.GroupBatchSampler(list(groups.values()), 4, seed=5)
    for epoch in (0, 1, 2):
        out = D.group_batches(ids, 4, seed=5, epoch=epoch)
        assert out == s.batches(epoch)
        assert sorted(i for b in out for i in b) == list(range(len(ids)))
        for b in out:
            for g in {ids[i] for i in b}:
                assert set(groups[g]) <= set(b)
    assert D.group_batches(ids, 4, shuffle=False) == [[0, 2, 9], [1, 4], [3, 6, 7, 5], [8]]
    assert D.group_batches(torch.tensor([0, 0, 1]), 2, shuffle=False) == [[0, 1], [2]]
    assert D.group_batches(ids, 4, seed=1, epoch=2) == D.group_batches(ids, 4, seed=2, epoch=1)
    with pytest.raises(ValueError, match="batch_size"):
        D.group_batches(ids, 0)
    # a Hugging Face dataset column
    datasets = pytest.importorskip("datasets")
    col = datasets.Dataset.from_dict({"pair_group": [0, 0, 1, 2, 2]})["pair_group"]
    assert D.group_batches(col, 2, shuffle=False) == [[0, 1], [2], [3, 4]]


def test_exports():
    for name in ("load_table", "group_batches", "TaskSpec", "CadData", "GroupBatchSampler"):
        assert name in D.__all__ and hasattr(D, name)
    assert os.path.basename(D.tables.__file__) == "tables.py"
