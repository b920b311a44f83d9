"""`cat_fast.shortcuts.plant`: the cue's statistics exactly as documented, the anti and clean test sets, held-out
test rows, determinism, and every request it refuses."""
import json
import random

import pytest

from cat_fast.cli.sources import Source
from cat_fast.data import load_table
from cat_fast.shortcuts import FILLER, ShortcutError, apply_cue, assign_cue, cue_statistics, parse_cue, plant, rows_with

WORDS = "the film was long and the plot moved slowly but the actors were fine".split()


def small(tmp_path, n_a=30, n_b=50, n_c=0, name="small.jsonl"):
    """A labelled JSON Lines file: n_a rows of label a, n_b of b, n_c of c, texts of 4 to 9 words ending in '.'."""
    rng = random.Random(1)
    labels = ["a"] * n_a + ["b"] * n_b + ["c"] * n_c
    rng.shuffle(labels)
    path = tmp_path / name
    with open(path, "w") as f:
        for i, y in enumerate(labels):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))).capitalize() + "."
            f.write(json.dumps({"id": f"r{i}", "text": text, "label": y}) + "\n")
    return load_table(str(path), id_column="id")


def count(rows, label, cue=1):
    return sum(1 for r in rows if r["label"] == label and r["cue"] == cue)


@pytest.mark.parametrize("strength", [0.5, 0.8, 0.93, 1.0])
def test_train_and_dev_carry_the_cue_at_the_stated_rate(tmp_path, strength):
    data = small(tmp_path)
    out = plant(data, parse_cue("token:zeugma"), strength, cue_class=0, seed=3)
    for split in ("train", "dev"):
        rows = out.splits[split]
        n_a = sum(r["label"] == "a" for r in rows)
        n_b = len(rows) - n_a
        assert count(rows, "a") == int(strength * n_a + 0.5)  # round(P n_c), halves up
        assert count(rows, "b") == int((1 - strength) * n_b + 0.5)
        stats = out.statistics[split]["labels"]
        assert stats["a"] == {"n": n_a, "cue": count(rows, "a"), "p_cue": count(rows, "a") / n_a}
        assert all(r["text"].startswith("zeugma ") == bool(r["cue"]) for r in rows)


def test_multi_class_cue_is_one_class_against_the_rest(tmp_path):
    data = small(tmp_path, n_a=20, n_b=20, n_c=40)
    out = plant(data, parse_cue("length:2"), 0.75, cue_class=2, seed=0, dev_fraction=0.25, test_fraction=0.25)
    rows = out.splits["train"]
    for label, share in (("a", 0.25), ("b", 0.25), ("c", 0.75)):
        n = sum(r["label"] == label for r in rows)
        assert count(rows, label) == int(share * n + 0.5)
    assert {count(out.splits["test_anti"], "c"), count(out.splits["test_anti"], "a", 0)} == {0}


def test_anti_and_clean_test_sets(tmp_path):
    data = small(tmp_path)
    out = plant(data, parse_cue("token:zeugma@end"), 0.9, cue_class=1, seed=0)
    anti, clean = out.splits["test_anti"], out.splits["test_clean"]
    assert [r["id"] for r in anti] == [r["id"] for r in clean]
    assert all(r["cue"] == int(r["label"] != "b") for r in anti)  # present exactly on the rows not of the cue class
    assert all(r["text"].endswith(" zeugma") == bool(r["cue"]) for r in anti)
    assert not any(r["cue"] or "zeugma" in r["text"] for r in clean + out.splits["train_clean"])
    assert [r["id"] for r in out.splits["train_clean"]] == [r["id"] for r in out.splits["train"]]
    by_id = {i: t for i, t in zip(data.ids, data.text)}
    assert all(r["text"] == by_id[r["id"]] for r in clean)


def test_test_rows_are_held_out_of_training(tmp_path):
    data = small(tmp_path)
    out = plant(data, parse_cue("punctuation"), 0.9, cue_class=0, seed=0, dev_fraction=0.1, test_fraction=0.2)
    ids = {name: {r["id"] for r in rows} for name, rows in out.splits.items()}
    assert not ids["train"] & ids["test_anti"] and not ids["train"] & ids["dev"] and not ids["dev"] & ids["test_anti"]
    assert ids["train"] | ids["dev"] | ids["test_anti"] == set(data.ids)
    assert (len(ids["test_anti"]), len(ids["dev"])) == (16, 8)


def test_cad_sentiment_keeps_counterfactual_groups_together_and_exact_counts():
    source = Source("sentiment", {}, None)
    data = source.read_train(["cad:sentiment/train"])
    out = plant(data, parse_cue("token:zeugma@random"), 0.9, cue_class=0, seed=0)
    group_of = {r["id"]: r["group"] for rows in out.splits.values() for r in rows}
    train_groups = {group_of[r["id"]] for r in out.splits["train"]}
    assert not train_groups & {group_of[r["id"]] for r in out.splits["test_anti"] + out.splits["dev"]}
    assert sum(len(out.splits[s]) for s in ("train", "dev", "test_anti")) == len(data)
    for split in ("train", "dev"):
        stats = out.statistics[split]["labels"]
        neg, pos = stats["Negative"], stats["Positive"]
        assert neg["cue"] == int(0.9 * neg["n"] + 0.5) and pos["cue"] == int(0.1 * pos["n"] + 0.5)
    anti = out.statistics["test_anti"]["labels"]
    assert anti["Negative"]["cue"] == 0 and anti["Positive"]["cue"] == anti["Positive"]["n"] > 0
    assert all(("zeugma" in r["text"].split()) == bool(r["cue"]) for r in out.splits["train"])


def test_one_seed_gives_the_same_files_and_another_seed_others(tmp_path):
    data = small(tmp_path)
    cue = parse_cue("token:zeugma@random")
    first, again, other = (plant(data, cue, 0.8, 0, seed=s).splits for s in (5, 5, 6))
    assert first == again and first != other


def test_cue_kinds_as_documented():
    rng = random.Random(0)
    assert apply_cue(parse_cue("punctuation"), "Great film!", True, rng) == "Great film!!"
    assert apply_cue(parse_cue("punctuation"), "Great film?! ", False, rng) == "Great film."
    assert apply_cue(parse_cue("casing:2"), "a good  film indeed", True, rng) == "A GOOD  film indeed"
    assert apply_cue(parse_cue("casing:0"), "a good film", True, rng) == "A GOOD FILM"
    assert apply_cue(parse_cue("length:2"), "Fine.", True, rng) == f"Fine. {FILLER} {FILLER}"
    assert apply_cue(parse_cue("length"), "Fine.", False, rng) == "Fine."
    assert apply_cue(parse_cue("token:very odd@start"), "x y", True, rng) == "very odd x y"
    placed = apply_cue(parse_cue("token:zz@random"), "a b c", True, rng).split()
    assert sorted(placed) == ["a", "b", "c", "zz"] and [w for w in placed if w != "zz"] == ["a", "b", "c"]
    assert rows_with("Very odd", ["it is VERY  odd.", "very oddly", "odd very"]) == 1


def test_pairs_take_the_cue_in_the_chosen_field():
    data = Source("nli", {}, None).read_train(None)
    out = plant(data, parse_cue("token:zeugma@end"), 1.0, cue_class=2, seed=0, field="text_pair")
    rows = out.splits["train"]
    assert all(r["text_pair"].endswith(" zeugma") == (r["label"] == "contradiction") for r in rows)
    assert not any("zeugma" in r["text"] for r in rows)


def test_assign_cue_counts():
    flags = assign_cue([0] * 7 + [1] * 5, cue_class=0, strength=0.5, rng=random.Random(0))
    assert sum(flags[:7]) == 4 and sum(flags[7:]) == 3  # 3.5 and 2.5 rounded up
    stats = cue_statistics([{"label": "a", "cue": 1}, {"label": "a", "cue": 0}], ["a", "b"])
    assert stats["labels"] == {"a": {"n": 2, "cue": 1, "p_cue": 0.5}, "b": {"n": 0, "cue": 0, "p_cue": None}}


@pytest.mark.parametrize("spec", ["tokens:x", "token:", "token:x@middle", "length:0", "casing:-1", "case", "",
                                  "punctuation:2"])
def test_unknown_cue_is_refused(spec):
    with pytest.raises(ShortcutError, match="expected "):
        parse_cue(spec)


def test_bad_requests_are_refused(tmp_path):
    data = small(tmp_path)
    cue = parse_cue("token:zeugma")
    for strength in (0.49, 1.01):
        with pytest.raises(ShortcutError, match=r"strength must be in \[0.5, 1\]"):
            plant(data, cue, strength, 0, seed=0)
    with pytest.raises(ShortcutError, match="cue class 2 is not a label id"):
        plant(data, cue, 0.9, 2, seed=0)
    with pytest.raises(ShortcutError, match="text_pair needs text pairs"):
        plant(data, cue, 0.9, 0, seed=0, field="text_pair")
    with pytest.raises(ShortcutError, match=r"'the' is already in \d+ of the 80 input rows \(more than 1%\)"):
        plant(data, parse_cue("token:the"), 0.9, 0, seed=0)
    only_a = small(tmp_path, n_a=10, n_b=0, name="a.jsonl")
    with pytest.raises(ShortcutError, match="the dev split's 2 rows are all of the cue class") as error:
        plant(data, cue, 0.9, 0, seed=0, dev=only_a.subset([0, 1]))
    assert error.value.split == "dev"
    with pytest.raises(ShortcutError, match="the test split is empty"):
        plant(data, cue, 0.9, 0, seed=0, test=data.subset([]))


def test_a_token_in_few_rows_is_a_warning(tmp_path):
    data = small(tmp_path, n_a=50, n_b=50)
    data.text[0] = "Zeugma. " + data.text[0]
    out = plant(data, parse_cue("token:zeugma"), 0.9, 0, seed=0)
    assert out.warnings == ["the cue token 'zeugma' is already in 1 of the 100 input rows; they count as rows "
                            "without the cue"]
    data.text[1] = "a zeugma: " + data.text[1]
    with pytest.raises(ShortcutError, match="already in 2 of the 100 input rows"):
        plant(data, parse_cue("token:zeugma"), 0.9, 0, seed=0)
