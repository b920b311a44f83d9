"""An embedding table's weight gradient: cat_fast's kernel (`kernels.triton.embedding_backward`, an int32 sort and
two launches; a small table's sums without a sort, with its sorted path beside) beside PyTorch's
``embedding_dense_backward``, on the step suite's batches (lengths in [T/2, T], the padding positions id 0,
BERT-base's tables: 30,522 words with ``padding_idx`` 0; 2 token types, all id 0). Each version runs 20 times inside
one CUDA graph, median of 7 replays, µs per call; the largest difference between cat_fast's and PyTorch's is printed
beside. GPU only.

    python benchmarks/tools/embedding_grad.py [--sizes 32x128 64x256]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repository root
from benchmarks.tools.row_kernels import graph_time_us  # noqa: E402
from cat_fast.kernels.triton import embedding_backward as emb  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["32x128", "64x256"], metavar="BxT")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("embedding_grad.py needs a CUDA device")
    torch.manual_seed(0)
    for size in args.sizes:
        B, T = (int(v) for v in size.split("x"))
        lengths = torch.randint(T // 2, T + 1, (B,), device="cuda")
        lengths[0] = T
        words = torch.randint(1000, 30522, (B, T), device="cuda")
        words[torch.arange(T, device="cuda") >= lengths[:, None]] = 0
        grad = torch.randn(B, T, 768, device="cuda")
        for name, ids, rows, pad in (("words", words, 30522, 0),
                                     ("token types", torch.zeros_like(words), 2, None)):
            ours = graph_time_us(lambda: emb.backward(grad, ids, rows, pad))
            theirs = graph_time_us(lambda: emb.reference_backward(grad, ids, rows, pad))
            diff = (emb.backward(grad, ids, rows, pad) - emb.reference_backward(grad, ids, rows, pad)).abs().max()
            sorted_path = ""
            if rows <= emb.LAUNCH["small_table"]:  # the same table through the sort, for comparison
                small, emb.LAUNCH["small_table"] = emb.LAUNCH["small_table"], 0
                try:
                    sorted_path = f", sorted path {graph_time_us(lambda: emb.backward(grad, ids, rows, pad)):.1f} us"
                finally:
                    emb.LAUNCH["small_table"] = small
            print(f"{size} {name}: cat_fast {ours:.1f} us{sorted_path}, PyTorch {theirs:.1f} us "
                  f"({theirs / ours:.2f}x), largest difference {diff.item():.2e}", flush=True)


if __name__ == "__main__":
    main()
