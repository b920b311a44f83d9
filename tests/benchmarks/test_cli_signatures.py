"""`benchmarks/tools/cli_signatures.py`: a `cat-fast train` run's graph signatures counted on the host, and the
Trainer's cache policy replayed over them."""
from benchmarks.tools import cli_signatures


def test_the_policy_warms_each_signature_up_then_captures_then_replays():
    a, b, c = ("a", "a0"), ("b", "b0"), ("c", None)  # packed signatures (with their padded one) and a padded one
    steps = [a, a, a, a, a, b, c, c]
    assert cli_signatures.replay_policy(steps, max_graphs=8, warmup=3) == (1, 6, 1, 0)
    assert cli_signatures.replay_policy(steps, max_graphs=8, warmup=1) == (3, 3, 2, 0)
    # at most half of max_graphs packed: b then runs as its padded signature; past max_graphs, eagerly
    assert cli_signatures.replay_policy([a, a, b, b, b], max_graphs=2, warmup=1) == (1, 2, 2, 0)
    assert cli_signatures.replay_policy([c, c, ("d", None), ("d", None)], max_graphs=1, warmup=1) == (0, 1, 1, 2)


def test_a_cli_cat_run_counted_on_the_host():
    """A CAT run like the README's (the built-in CAD sentiment data, MiniLM, 32 examples a class and their edits,
    16 a batch, 2 epochs: 16 steps, every batch over 4,096 rows): each step's signature
    from the run's own batches and CAT's plan, fewer eager steps with one warm-up step than with three, and coarser
    buckets key no more signatures."""
    argv = ["--task", "sentiment", "--method", "cat", "--per-class", "32", "--epochs", "2", "--batch-size", "16",
            "--max-length", "256"]
    fine = cli_signatures.count(argv, warmups=(3, 1))
    coarse = cli_signatures.count(argv, warmups=(3,), buckets=(8, 8))
    assert fine["steps"] == coarse["steps"] == 16 and fine["packed_steps"] == fine["steps"]
    assert 1 <= coarse["signatures"] <= fine["signatures"] <= fine["steps"]
    for record in (fine, coarse):
        policy = record["warmup_3"]
        assert sum(policy.values()) == record["steps"]
    assert fine["warmup_1"]["eager_warmup"] < fine["warmup_3"]["eager_warmup"]
    assert fine["buckets"] == [32, 16] and coarse["buckets"] == [8, 8]


def test_a_missing_training_file_ends_in_one_line(capsys):
    """A run the CLI would refuse ends as `cat-fast train` ends: one line naming the problem, exit 2."""
    import pytest

    with pytest.raises(SystemExit) as ended:
        cli_signatures.main(["--method", "cat", "--train", "/nonexistent/train.tsv", "--text-column", "t",
                             "--label-column", "l"])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.count("\n") == 1
    assert err.startswith("cat-fast: error: /nonexistent/train.tsv: file or folder not found")
