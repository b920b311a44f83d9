"""cat_fast.layers.embedding: the embedding tables' weight gradients summed by cat_fast's kernel during a fast
training forward. On the CPU the kernel runs under the Triton interpreter."""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cat_fast import models
from cat_fast.layers import embedding, training
from tests.conftest import tiny_batch, tiny_model

CUDA = torch.cuda.is_available()
KERNELS = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.skipif(not KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_a_lookup_is_the_tables_forward_and_weight_gradient(padding_idx):
    pytest.importorskip("triton")
    dtype = torch.float64 if DEVICE == "cpu" else torch.float32
    table = nn.Embedding(30, 12, padding_idx=padding_idx, dtype=dtype, device=DEVICE)
    ids = torch.randint(0, 30, (3, 20), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    ids[:, -4:] = 0
    upstream = torch.randn(3, 20, 12, generator=torch.Generator().manual_seed(1), dtype=dtype).to(DEVICE)
    out = embedding.lookup(table, ids)
    assert torch.equal(out, table(ids))
    (got,) = torch.autograd.grad(out, table.weight, upstream)
    (want,) = torch.autograd.grad(table(ids), table.weight, upstream)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if padding_idx is not None:
        assert got[padding_idx].eq(0).all()


def test_a_backward_that_builds_a_graph_runs_pytorchs():
    # create_graph: the weight gradient stays differentiable (PyTorch's backward, which has a derivative)
    table = nn.Embedding(10, 4, dtype=torch.float64)
    scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[1, 2, 2, 7], [0, 7, 7, 7]])
    results = []
    for look in (lambda: embedding.lookup(table, ids), lambda: table(ids)):
        loss = (look() * scale).square().sum()
        (gw,) = torch.autograd.grad(loss, table.weight, create_graph=True)
        assert gw.grad_fn is not None
        results.append((gw.detach(), torch.autograd.grad(gw.square().sum(), scale)[0]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-12, atol=1e-12)


def _tables(model):
    return [m for m in models.structure(model).embeddings.modules() if isinstance(m, nn.Embedding)]


def test_lookups_patch_nothing_off_cuda():
    model = tiny_model("bert", attn="sdpa")
    with embedding.lookups(models.structure(model).embeddings):
        assert not any("forward" in m.__dict__ for m in _tables(model))
    with embedding.lookups(None):
        pass


@pytest.mark.parametrize("value", ["no", 1, None])
def test_a_bad_setting_is_named(value, monkeypatch):
    monkeypatch.setattr(embedding, "FAST", value)
    with pytest.raises(ValueError, match=f"cat_fast.layers.embedding.FAST: expected True or False, got {value!r}"):
        with embedding.lookups(None):
            pass


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_lookups_patch_the_plain_tables_only_and_restore_them(monkeypatch):
    model = tiny_model("bert", attn="sdpa").cuda()
    word, position, token_type = _tables(model)
    handle = token_type.register_forward_hook(lambda *a: None)
    position.max_norm = 1.0
    calls = []
    monkeypatch.setattr(embedding, "lookup", lambda *a: calls.append(1) or F.embedding(a[1], a[0].weight))
    with embedding.lookups(models.structure(model).embeddings):
        assert "forward" in word.__dict__
        assert "forward" not in position.__dict__ and "forward" not in token_type.__dict__
        ids = torch.tensor([[1, 2, 3]], device="cuda")
        assert torch.equal(word(ids), F.embedding(ids, word.weight))
        assert calls == [1]
        with torch.no_grad():
            word(ids)
        assert calls == [1]  # no gradient wanted: its own forward
    assert not any("forward" in m.__dict__ for m in (word, position, token_type))
    handle.remove()
    monkeypatch.setattr(embedding, "FAST", False)
    with embedding.lookups(models.structure(model).embeddings):
        assert "forward" not in word.__dict__


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_fast_training_forward_gives_the_tables_gradients(monkeypatch):
    """A fast training forward (the fused layers, bf16 autocast, no dropout) with and without `FAST`: the lookups
    run, and the embedding tables' gradients agree to fp32 rounding; every other gradient is the same."""
    monkeypatch.setattr(training, "FUSED_MIN_ROWS", 0)
    calls = []
    real = embedding.lookup
    monkeypatch.setattr(embedding, "lookup", lambda *a: calls.append(1) or real(*a))
    grads = {}
    for fast in (False, True):
        monkeypatch.setattr(embedding, "FAST", fast)
        model = tiny_model("bert", attn="sdpa", num_layers=3, hidden_size=64, num_attention_heads=4,
                           intermediate_size=256, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                           seed=0).cuda().train()
        batch = {k: v.cuda() for k, v in tiny_batch("bert", batch=4, length=40).items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = models.first_token_forward(model, batch, training_layers=True).logits
        F.cross_entropy(logits.float(), batch["labels"]).backward()
        grads[fast] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert len(calls) == 3  # word, position and token-type tables, once each
    assert grads[True].keys() == grads[False].keys()
    for name, want in grads[False].items():
        if "embeddings" in name and "LayerNorm" not in name:
            torch.testing.assert_close(grads[True][name], want, rtol=1e-5, atol=1e-6)
            assert want.abs().sum() > 0
        else:
            assert torch.equal(grads[True][name], want), name
