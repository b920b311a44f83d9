"""cat_fast.bias.expand_two_class: Clark's 2-class (entailment vs not) bias spread over the main task's labels."""
import math

import pytest
import torch

from cat_fast.bias import expand_two_class


def two_class(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(n, 2, generator=g, dtype=torch.float64), 1)


def test_library_and_clark_order():
    b2 = two_class()
    ent, non = b2[:, 0], b2[:, 1]
    # the library's NLI order: entailment, neutral, contradiction
    out = expand_two_class(b2, entailment_index=0)
    torch.testing.assert_close(out, torch.stack([ent, non - math.log(2), non - math.log(2)], 1), rtol=0, atol=0)
    # Clark's order (contradiction, entailment, neutral), his files holding entailment in column 1
    clark = expand_two_class(b2.flip(1), entailment_index=1, entailment_column=1)
    torch.testing.assert_close(clark, torch.stack([non - math.log(2), ent, non - math.log(2)], 1), rtol=0, atol=0)
    for o in (out, clark):
        torch.testing.assert_close(torch.logsumexp(o, 1), torch.zeros(5, dtype=torch.float64), rtol=0, atol=1e-15)


def test_more_classes_dtype_and_grad():
    b2 = two_class().float().requires_grad_()
    out = expand_two_class(b2, entailment_index=3, num_classes=4)
    assert out.shape == (5, 4) and out.dtype == torch.float32
    torch.testing.assert_close(out[:, 0], b2[:, 1] - math.log(3))
    torch.testing.assert_close(torch.logsumexp(out, 1), torch.zeros(5), rtol=0, atol=1e-6)
    out.sum().backward()
    assert b2.grad is not None


def test_errors():
    b2 = two_class()
    with pytest.raises(ValueError, match=r"expected a tensor \[N, 2\]"):
        expand_two_class(b2[:, :1], 0)
    with pytest.raises(ValueError, match="entailment_index=3"):
        expand_two_class(b2, 3)
    with pytest.raises(ValueError, match="num_classes=1"):
        expand_two_class(b2, 0, num_classes=1)
    with pytest.raises(ValueError, match="entailment_column=2"):
        expand_two_class(b2, 0, entailment_column=2)
