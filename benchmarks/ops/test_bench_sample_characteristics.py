"""sample_characteristics (CLP's ten per-sample characteristics, docs/METHODS.md §5.1) on logits [B, C], features
[B, H] and the head's weight [C, H]; forward and the gradients w.r.t. logits, features and weight.

Sizes are B x C x H: CLP batches (128, the paper's) of a 3-class NLI head on MiniLM (384) and BERT-base (768) widths,
100 and 1000 classes, and a large batch. class_stats float32. Minimal bytes (s = element size): forward = read
logits B C s, labels 8 B, features B H s, the weight rows of the batch's labels min(B, C) H s, class_stats 12 C,
write 40 B; backward = read grad 40 B, logits, labels, features and the weight C H s, write grad_logits B C s,
grad_features B H s and grad_weight C H s. Kernel launches per direction are counted (target: 1 each).
"""
import pytest
import torch

from benchmarks.ops import harness as H

pytestmark = pytest.mark.benchmark(timer=H.virtual_clock)

SIZES_GPU = ("128x3x384", "128x3x768", "128x100x768", "512x1000x768", "8192x3x768")
SIZES_CPU = ("32x3x64", "256x10x128")


@pytest.mark.parametrize(H.OP_ARGNAMES, H.op_params(SIZES_GPU, SIZES_CPU))
def test_sample_characteristics(benchmark, copy_bandwidth, device, backend, size, dtype):
    rows, classes, width = H.dims(size)
    torch.manual_seed(0)
    dt = H.DTYPES[dtype]
    logits = (3 * torch.randn(rows, classes, device=device)).to(dt).requires_grad_()
    features = torch.randn(rows, width, device=device).to(dt).requires_grad_()
    weights = (torch.randn(classes, width, device=device) / width**0.5).to(dt).requires_grad_()
    labels = torch.randint(0, classes, (rows,), device=device)
    stats = torch.rand(classes, 3, device=device)
    grad_out = torch.ones(rows, 10, device=device)
    s = logits.element_size()
    reads = rows * classes * s + 8 * rows + rows * width * s
    measure = H.op_measure(
        "sample_characteristics", backend, device,
        forward=lambda fn: fn(logits, labels, features, weights, stats),
        grad_inputs=(logits, features, weights), grad_outputs=grad_out,
        bytes_fwd=reads + min(rows, classes) * width * s + 12 * classes + 40 * rows,
        bytes_bwd=reads + 40 * rows + classes * width * s + (rows * classes + rows * width + classes * width) * s,
        count_launches=True,
    )
    H.finish(H.record(benchmark, measure, group="sample_characteristics", shape=size, dtype=dtype))
