"""`benchmarks/tools/cli_signatures.py`: a `cat-fast train` run's graph signatures counted on the host, and the
Trainer's cache policy replayed over them."""
from benchmarks.tools import cli_signatures


def test_the_policy_warms_each_signature_up_then_captures_then_replays():
    a, b, c = ("a", "a0", 10, 100), ("b", "b0", 20, 100), ("c", None, None, 100)  # packed (padded, rows) and padded
    steps = [a, a, a, a, a, b, c, c]
    assert cli_signatures.replay_policy(steps, max_graphs=8, warmup=3) == (1, 6, 1, 0, 0)
    assert cli_signatures.replay_policy(steps, max_graphs=8, warmup=1) == (3, 3, 2, 0, 0)
    # at most half of max_graphs packed: b then runs as its padded signature; past max_graphs, eagerly
    assert cli_signatures.replay_policy([a, a, b, b, b], max_graphs=2, warmup=1) == (1, 2, 2, 0, 0)
    assert cli_signatures.replay_policy([c, c, ("d", None, None, 100), ("d", None, None, 100)], max_graphs=1,
                                        warmup=1) == (0, 1, 1, 2, 0)


def test_the_policy_warms_a_batch_shape_up_once():
    """The packed signatures of one padded signature share its `warmup` eager steps; a new row count is then captured
    at once (`COUNT_WARMUP`: the capture measures its dropout offsets), or after one eager step of its own where the
    extension cannot read offsets inside a capture (``count_warmup=1``)."""
    x, y, z = ("x", "p", 10, 100), ("y", "p", 40, 100), ("z", "p", 70, 100)
    steps = [x, y, x, y, x, y, z, z, z]
    # x, y, x: the batch shape's three; then y and x captured; z captured at first sight
    assert cli_signatures.replay_policy(steps, max_graphs=8, warmup=3) == (3, 3, 3, 0, 0)
    # with one eager step a count: z's first step is eager
    assert cli_signatures.replay_policy(steps, max_graphs=8, warmup=3, count_warmup=1) == (2, 4, 3, 0, 0)


def test_the_policy_shares_a_graph_of_more_rows(monkeypatch):
    """A packed signature replays a captured one of the same padded signature with at most ``share_rows`` of the
    batch's rows more (not one of another padded signature, nor one with fewer rows), until it has shared
    `OWN_GRAPH_AFTER` times: then its own capture (after one eager step with ``count_warmup=1``)."""
    from cat_fast import step

    monkeypatch.setattr(step, "OWN_GRAPH_AFTER", 2)
    big, small, other, bigger = ("big", "p", 30, 100), ("small", "p", 20, 100), ("o", "q", 20, 100), ("x", "p", 60, 100)
    steps = [big, big, small, small, small, small, small, other, bigger]
    # big: eager, capture; small: shared, shared, capture, two replays (unshared: capture, four replays);
    # other: eager (its batch shape's warm-up); bigger (30 rows more): captured
    assert cli_signatures.replay_policy(steps, max_graphs=8, warmup=1, share_rows=0.125) == (4, 2, 3, 0, 2)
    assert cli_signatures.replay_policy(steps, max_graphs=8, warmup=1, share_rows=0.0) == (4, 2, 3, 0, 0)
    assert cli_signatures.replay_policy([big, big, small], max_graphs=8, warmup=1, share_rows=0.05) == (0, 1, 2, 0, 0)
    # one eager step a count: small's third step and bigger's first are eager, and small replays once
    assert cli_signatures.replay_policy(steps, max_graphs=8, warmup=1, share_rows=0.125, count_warmup=1) == (
        3, 4, 2, 0, 2)
    assert cli_signatures.replay_policy(steps, max_graphs=8, warmup=1, share_rows=0.0, count_warmup=1) == (
        3, 4, 2, 0, 0)


def test_packed_steps_that_do_not_share_warm_up_on_their_own():
    """A packed step flagged as not sharing (under DDP, where not every rank packs) warms up as a signature of its
    own: its batch shape's warm-up steps do not count for it, and it replays no other signature's graph."""
    x, y = ("x", "p", 12, 100), ("y", "p", 10, 100)
    steps = [x, x, x, y, y, y]
    # sharing: x warms the batch shape up and is captured; y replays x's graph (2 rows more: within 12.5)
    assert cli_signatures.replay_policy(steps, max_graphs=8, warmup=2, share_rows=0.125) == (3, 2, 1, 0, 3)
    # apart: y warms up on its own and is captured
    apart = [step + (False,) for step in steps]
    assert cli_signatures.replay_policy(apart, max_graphs=8, warmup=2, share_rows=0.125) == (0, 4, 2, 0, 0)


def test_the_ranks_steps_are_agreed_as_lockstep_agrees_them():
    """`_agreed`: where every rank packs, each runs the ranks' largest counts and the key names them (sharing); where
    some rank does not pack, each runs its own counts and the key names every rank's (no sharing); where none
    packs, the padded key; every key names both ranks' numbers for their padded signatures."""
    a, b = (("A",), ("cat", 4)), (("B",), ("cat", 4))
    rank0 = [(a, 100, 400, (4, 100)), (a, 90, 400, (4, 100)), (a, None, 400, (4, 100))]
    rank1 = [(b, 120, 400, (4, 100)), (b, None, 400, (4, 100)), (b, None, 400, (4, 100))]
    steps0, steps1 = cli_signatures._agreed([rank0, rank1])
    key0 = (("A",), (("cat", 4), (0, 0)))
    assert steps0[0] == ((key0[0], (key0[1], ("rows", 120))), key0, 120, 400, True)
    assert steps1[0][2:] == (120, 400, True) and steps1[0][1] == (("B",), (("cat", 4), (0, 0)))
    assert steps0[1] == ((key0[0], (key0[1], ("rows", ((90,), ())))), key0, 90, 0, False)
    assert steps1[1][2:] == (None, 0, False)
    assert steps0[2] == (key0, None, None, 400) and steps1[2][1:] == (None, None, 400)


def test_a_cli_cat_run_counted_on_the_host():
    """A CAT run like the README's (the built-in CAD sentiment data, MiniLM, 32 examples a class and their edits,
    16 a batch, 2 epochs: 16 steps, every batch over 4,096 rows): each step's signature
    from the run's own batches and CAT's plan, fewer eager steps with one warm-up step than with three, and coarser
    buckets key no more signatures."""
    argv = ["--task", "sentiment", "--method", "cat", "--per-class", "32", "--epochs", "2", "--batch-size", "16",
            "--max-length", "256"]
    fine = cli_signatures.count(argv, warmups=(3, 1), shares=(0.0,))
    coarse = cli_signatures.count(argv, warmups=(3,), buckets=(8, 8), shares=(0.0, 1.0))
    assert fine["steps"] == coarse["steps"] == 16 and fine["packed_steps"] == fine["steps"]
    assert 1 <= coarse["signatures"] <= fine["signatures"] <= fine["steps"]
    for record in (fine, coarse):
        for policy in record["policies"]:
            counts = [policy[k] for k in ("replayed", "eager_warmup", "captures", "eager_past_limits")]
            assert sum(counts) == record["steps"] and policy["shared"] <= policy["replayed"]
    three, one = fine["policies"]
    assert (three["warmup_steps"], one["warmup_steps"]) == (3, 1) and one["eager_warmup"] < three["eager_warmup"]
    unshared, shared = coarse["policies"]
    assert unshared["shared"] == 0 and shared["captures"] <= unshared["captures"]
    assert fine["buckets"] == [32, 16] and coarse["buckets"] == [8, 8]


def test_a_cli_cat_run_on_two_ranks_counted_on_the_host():
    """The same run as two torchrun ranks: each takes every other batch (8 steps each), the ranks' keys give every
    rank the same counts, and every step is counted once."""
    argv = ["--task", "sentiment", "--method", "cat", "--per-class", "32", "--epochs", "2", "--batch-size", "16",
            "--max-length", "256"]
    record = cli_signatures.count(argv, warmups=(3, 1), shares=(0.0, 0.125), ranks=2)
    assert record["ranks"] == 2 and record["steps"] == 8 and record["ranks_agree"] is True
    assert 1 <= record["signatures"] <= record["steps"]
    for policy in record["policies"]:
        counts = [policy[k] for k in ("replayed", "eager_warmup", "captures", "eager_past_limits")]
        assert sum(counts) == record["steps"] and policy["shared"] <= policy["replayed"]


def test_a_missing_training_file_ends_in_one_line(capsys):
    """A run the CLI would refuse ends as `cat-fast train` ends: one line naming the problem, exit 2."""
    import pytest

    with pytest.raises(SystemExit) as ended:
        cli_signatures.main(["--method", "cat", "--train", "/nonexistent/train.tsv", "--text-column", "t",
                             "--label-column", "l"])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.count("\n") == 1
    assert err.startswith("cat-fast: error: /nonexistent/train.tsv: file or folder not found")
