"""cat_fast.analysis.k_selection: the curve of a tiny model masked in place, the rules, the grid."""
import pytest
import torch

from cat_fast.analysis import k_selection as K
from cat_fast.analysis import masking
from tests.conftest import tiny_model

# the last layer's output at the first token feeds the head: masking all of it changes most predictions
RANKED = [(2, "output", i) for i in range(32)] + [(1, "intermediate", i) for i in range(64)]


def _setup():
    model = tiny_model("bert", num_layers=2, num_labels=3).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (48, 7), generator=g)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        labels = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)  # the unmasked model is always right
    batches = [{"input_ids": ids[i:i + 16], "attention_mask": mask[i:i + 16], "labels": labels[i:i + 16]}
               for i in range(0, 48, 16)]
    shuffled = [dict(b, labels=(b["labels"] + 1) % 3) for b in batches]  # the unmasked model is always wrong
    return model, batches, shuffled


def test_curve_bookkeeping_and_k0():
    model, batches, shuffled = _setup()
    with torch.no_grad():
        before = model(**{k: v for k, v in batches[0].items() if k != "labels"}).logits
    grid = K.parse_grid("4,1,16,32,8", swept=96)
    assert grid == [0, 1, 4, 8, 16, 32]
    curve = K.k_curve(model, RANKED, grid, {"dev": batches, "anti": shuffled})
    assert [p["k"] for p in curve] == grid
    assert curve[0]["accuracy"] == {"dev": 1.0, "anti": 0.0}  # k = 0: the unmasked model
    assert curve[-1]["accuracy"]["dev"] < 0.9  # the whole first-token output masked
    for point in curve[1:]:  # each k from a clean mask, not stacked on the previous one
        masking.mask_neurons(model, RANKED[:point["k"]])
        try:
            assert K.accuracy(model, batches) == point["accuracy"]["dev"]
        finally:
            masking.unmask_neurons(model)
    assert masking.masked_neurons(model) is None
    with torch.no_grad():
        after = model(**{k: v for k, v in batches[0].items() if k != "labels"}).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)  # left unmasked

    # max-drop on this curve: D set to the drop at one k keeps the prefix up to the last k within it
    drops = [100 * (1.0 - p["accuracy"]["dev"]) for p in curve]
    for i, d in enumerate(drops):
        expect = grid[max(j for j in range(len(grid)) if max(drops[:j + 1]) <= d)]
        assert K.choose_k(curve, K.Rule("max-drop", d), "dev") == expect
        assert expect >= grid[i] or max(drops[:i + 1]) > d
    best = max(p["accuracy"]["anti"] for p in curve)
    k = K.choose_k(curve, K.parse_rule("best-on:anti.tsv"), "anti")
    assert next(p["accuracy"]["anti"] for p in curve if p["k"] == k) == best


def test_rules_on_a_written_curve():
    curve = [{"k": k, "accuracy": {"dev": a, "anti": b}} for k, a, b in
             [(0, 0.90, 0.40), (5, 0.89, 0.50), (10, 0.88, 0.55), (20, 0.85, 0.55), (40, 0.88, 0.52), (80, 0.60, 0.30)]]
    assert K.choose_k(curve, K.parse_rule("max-drop:3"), "dev") == 10  # 20 drops 5 points: 40 is not reached
    assert K.choose_k(curve, K.parse_rule("max-drop"), "dev") == 10  # D defaults to 3
    assert K.choose_k(curve, K.parse_rule("max-drop:5"), "dev") == 40
    assert K.choose_k(curve, K.parse_rule("max-drop:0"), "dev") == 0
    assert K.choose_k(curve, K.parse_rule("best-on:anti.tsv"), "anti") == 10  # tie with 20: the smaller k
    with pytest.raises(ValueError, match="starting at k = 0"):
        K.choose_k(curve[1:], K.parse_rule("max-drop:3"), "dev")


@pytest.mark.parametrize("spec, match", [("200", "larger than the 96 neurons"), ("150%", "percentage"),
                                         ("0", "whole number"), ("x", "whole number"), ("", "at least one k")])
def test_grid_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        K.parse_grid(spec, swept=96)


def test_grid_percentages_and_rules():
    assert K.parse_grid("0.5%,1%,50%", swept=1000) == [0, 5, 10, 500]
    assert K.parse_grid("0.1%", swept=96) == [0, 1]  # at least one neuron
    assert K.parse_grid(K.DEFAULT_GRID, swept=224)[0] == 0
    for bad in ("max-drop:-1", "max-drop:x", "best-on", "best-on:", "top:3"):
        with pytest.raises(ValueError, match="k rule"):
            K.parse_rule(bad)


@pytest.mark.parametrize("lo, hi, limit, steps, scored", [
    (16, 64, 37, 3, [40, 28, 34]),       # fail, pass, pass: 34 is the largest passing k found
    (16, 64, 37, 10, [40, 28, 34, 37, 38]),  # run to the end: the exact threshold, then no k left between
    (0, 1, 5, 3, []),                     # no whole k between
    (8, 16, 100, 2, [12, 14]),            # everything passes: climbs towards hi
])
def test_bisect_largest(lo, hi, limit, steps, scored):
    assert K.bisect_largest(lo, hi, lambda k: k <= limit, steps) == scored


def test_refine_max_drop_scores_the_gap_above_the_grids_pick():
    model, batches, _ = _setup()
    exact = K.k_curve(model, RANKED, list(range(33)), {"dev": batches})  # every k, to check against
    drops = [100 * (1.0 - p["accuracy"]["dev"]) for p in exact]
    rule = K.Rule("max-drop", 13.0)
    assert drops[12] <= 13 and drops[32] > 13 and all(d <= 13 for d in drops[12:24]) and drops[24] > 13
    curve = K.k_curve(model, RANKED, [0, 12, 32], {"dev": batches})
    assert K.choose_k(curve, rule, "dev") == 12  # the grid's pick; 32 fails
    refined = K.refine_max_drop(model, RANKED, curve, rule, "dev", {"dev": batches}, steps=5)
    assert [p["k"] for p in refined] == [0, 12, 22, 23, 24, 27, 32]  # scored 22, 27, 24, 23, then no k between
    assert [p["k"] for p in refined if p.get("refined")] == [22, 23, 24, 27]
    for p in refined:  # each scored as on its own
        assert p["accuracy"]["dev"] == exact[p["k"]]["accuracy"]["dev"]
    assert K.choose_k(refined, rule, "dev") == 23  # the largest k before the first failing one (24)
    assert masking.masked_neurons(model) is None
    assert [p["k"] for p in K.refine_max_drop(model, RANKED, curve, rule, "dev", {"dev": batches}, steps=1)] == \
        [0, 12, 22, 32]
    assert K.refine_max_drop(model, RANKED, curve, K.Rule("best-on", "x"), "dev", {"dev": batches}) == curve
    top = K.k_curve(model, RANKED, [0, 4], {"dev": batches})  # the pick is the curve's last k: nothing to refine
    assert K.refine_max_drop(model, RANKED, top, K.Rule("max-drop", 100.0), "dev", {"dev": batches}) == top
