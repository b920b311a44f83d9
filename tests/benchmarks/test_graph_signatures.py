"""`benchmarks/tools/graph_signatures.py`: the graph signatures of a packed CAT step's draws, counted on the host."""
from benchmarks.tools import graph_signatures


def test_coarser_lent_buckets_key_no_more_graphs():
    """Lent rows in 16ths of the batch's rows key no more signatures than 32nds, on each rank and under DDP; the
    lent counts are multiples of the bucket."""
    fine, coarse = (graph_signatures.signatures("32x128", n, steps=40, ranks=2, layers=3) for n in (32, 16))
    assert coarse["signatures_ddp"] <= fine["signatures_ddp"]
    assert all(c <= f for c, f in zip(coarse["signatures_per_rank"], fine["signatures_per_rank"]))
    assert coarse["lent_counts"] and all(n % 256 == 0 for n in coarse["lent_counts"])
    assert all(n % 128 == 0 for n in fine["lent_counts"]) and fine["lent_counts"] != coarse["lent_counts"]
