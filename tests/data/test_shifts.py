"""The noisy-label and long-tail training sets (cat_fast.data.with_label_noise / long_tail, cat-fast train
--label-noise / --long-tail)."""
import pytest

from cat_fast import data


def test_label_noise_flips_the_given_share_to_other_classes():
    train = data.load_builtin("nli", "train").originals()
    noisy, flipped = data.with_label_noise(train, 0.2, seed=3)
    assert len(flipped) == round(0.2 * len(train)) and len(noisy) == len(train)
    changed = [i for i in range(len(train)) if noisy.labels[i] != train.labels[i]]
    assert changed == flipped  # every flipped label moved to another class; nothing else changed
    assert noisy.ids == train.ids and noisy.text == train.text
    again, _ = data.with_label_noise(train, 0.2, seed=3)
    assert again.labels == noisy.labels and data.with_label_noise(train, 0.2, seed=4)[0].labels != noisy.labels
    assert data.with_label_noise(train, 0.0)[0].labels == train.labels
    counts = [sum(1 for i in flipped if noisy.labels[i] == c) for c in range(3)]
    assert min(counts) > 0.2 * len(flipped)  # spread over the classes
    with pytest.raises(data.DataError, match="--label-noise must be in \\[0, 1\\)"):
        data.with_label_noise(train, 1.0)


def test_long_tail_keeps_a_fraction_of_one_class():
    train = data.load_builtin("nli", "train")
    tail = data.long_tail(train, "neutral", 0.1, seed=0)
    n = train.label_names.index("neutral")
    before = sum(y == n for y in train.labels)
    assert sum(y == n for y in tail.labels) == -(-before // 10)
    assert [y for y in tail.labels if y != n] == [y for y in train.labels if y != n]
    assert set(tail.ids) <= set(train.ids)
    with pytest.raises(data.DataError, match="'maybe' is not a label"):
        data.long_tail(train, "maybe", 0.1)
    with pytest.raises(data.DataError, match="fraction must be in \\(0, 1\\]"):
        data.long_tail(train, "neutral", 0.0)
