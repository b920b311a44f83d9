"""Shared tiny-model fixtures for the training-API tests (models, CAT, GS, trainers). No downloads."""
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

TINY_ARCHS = ("bert", "roberta", "distilbert", "albert", "electra", "deberta-v2")


def tiny_config(arch, num_layers=3, num_labels=3, attn="eager", **extra):
    """A random tiny config: hidden 32, 4 heads, vocab 100; dropout kept (tests choose eval/train)."""
    T = transformers
    common = dict(vocab_size=100, num_labels=num_labels, pad_token_id=0)
    if arch == "distilbert":
        cfg = T.DistilBertConfig(dim=32, n_layers=num_layers, n_heads=4, hidden_dim=64, max_position_embeddings=64,
                                 **common)
    elif arch == "gpt2":
        cfg = T.GPT2Config(n_embd=32, n_layer=num_layers, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2,
                           **common)
    else:
        kw = dict(hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=64, type_vocab_size=2, **common)
        if arch == "albert":
            cfg = T.AlbertConfig(embedding_size=16, **kw)
        elif arch == "deberta-v2":
            cfg = T.DebertaV2Config(relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8,
                                    max_relative_positions=16, conv_kernel_size=3, norm_rel_ebd="layer_norm", **kw)
        elif arch == "roberta":
            kw.update(type_vocab_size=1)
            cfg = T.RobertaConfig(bos_token_id=1, eos_token_id=2, **kw)
        elif arch == "electra":
            cfg = T.ElectraConfig(embedding_size=32, **kw)
        elif arch == "bert":
            cfg = T.BertConfig(**kw)
        else:
            raise ValueError(arch)
    for k, v in extra.items():
        setattr(cfg, k, v)
    cfg._attn_implementation = attn
    return cfg


def tiny_model(arch, task="cls", num_layers=3, num_labels=None, attn="eager", seed=0, dtype=torch.float32, **extra):
    if num_labels is None:
        num_labels = 2 if task == "qa" else 3
    torch.manual_seed(seed)
    cfg = tiny_config(arch, num_layers=num_layers, num_labels=num_labels, attn=attn, **extra)
    if task == "qa":
        model = transformers.AutoModelForQuestionAnswering.from_config(cfg, attn_implementation=attn)
    else:
        model = transformers.AutoModelForSequenceClassification.from_config(cfg, attn_implementation=attn)
    return model.to(dtype)


def tiny_batch(arch, batch=4, length=9, num_labels=3, seed=1, padded=True):
    """Random ids (ids >= 3 so no accidental special tokens), padding on some rows, labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if padded:
        for i in range(1, batch, 2):
            cut = length - 2 - (i % 3)
            mask[i, cut:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    out = {"input_ids": ids, "attention_mask": mask,
           "labels": torch.randint(0, num_labels, (batch,), generator=g)}
    if arch in ("bert", "albert", "electra", "deberta-v2"):
        out["token_type_ids"] = torch.zeros_like(ids)
    return out


@pytest.fixture
def make_tiny_model():
    """Factory fixture: make_tiny_model(arch, task="cls"|"qa", num_layers=3, attn="eager", ...)."""
    return tiny_model


@pytest.fixture
def make_tiny_batch():
    """Factory fixture: make_tiny_batch(arch, batch=4, length=9, ...) with padded rows and labels."""
    return tiny_batch


def cat_steps(model, cat, arch="bert", steps=3, seed=None):
    """Run `steps` CAT steps (``loss.backward()`` each, gradients accumulating) on ``tiny_batch(arch, batch=5)``:
    ([(loss, info)] per step, {parameter name: accumulated gradient})."""
    if seed is not None:
        torch.manual_seed(seed)
    out = []
    for _ in range(steps):
        loss, info = cat(tiny_batch(arch, batch=5))
        loss.backward()
        out.append((loss.detach(), {k: v.clone() for k, v in info.items()}))
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def cat_steps_fast_and_own(option, prune, calls, what):
    """`cat_steps` of a float64 tiny BERT in train mode (dropout) with CAL steps, CAT built with ``option=True``
    and then ``option=False``: [fast, own]. `calls` is a list the patched fast path appends to: filled by the first
    run (else `what` "never ran"), empty after the second (the model's own layers only)."""
    from cat_fast.objectives import CAT

    results = []
    for fast in (True, False):
        model = tiny_model("bert", attn="sdpa", dtype=torch.float64, num_layers=4, hidden_dropout_prob=0.3,
                           attention_probs_dropout_prob=0.3).train()
        cat = CAT(model, layers=[0, 1, 2], adv_steps=2, adv_lr=0.5, generator=torch.Generator().manual_seed(5),
                  prune_last_layer=prune, **{option: fast})
        results.append(cat_steps(model, cat, seed=11))
        if fast:
            assert calls, f"{what} never ran"
            calls.clear()
    assert not calls
    return results


def assert_same_cat_steps(got, want):
    """`cat_steps` results equal to float64 rounding: losses, every info entry, every parameter gradient."""
    (steps_a, grads_a), (steps_b, grads_b) = got, want
    for (la, ia), (lb, ib) in zip(steps_a, steps_b):
        torch.testing.assert_close(la, lb, rtol=1e-10, atol=1e-12)
        for k in ia:
            torch.testing.assert_close(ia[k], ib[k], rtol=1e-10, atol=1e-12)
    assert grads_a.keys() == grads_b.keys()
    for n in grads_a:
        torch.testing.assert_close(grads_a[n], grads_b[n], rtol=1e-9, atol=1e-12, msg=n)
