"""cat_fast.models: layer discovery, capture/resume exactness on every supported encoder, pooled representation."""
import pytest
import torch

from cat_fast import models
from tests.conftest import TINY_ARCHS, tiny_batch, tiny_config, tiny_model, transformers

LAYER_LISTS = {
    "bert": "bert.encoder.layer",
    "roberta": "roberta.encoder.layer",
    "distilbert": "distilbert.transformer.layer",
    "albert": "albert.encoder.albert_layer_groups",
    "electra": "electra.encoder.layer",
    "deberta-v2": "deberta.encoder.layer",
}
CASES = [(a, "eager") for a in TINY_ARCHS] + [("bert", "sdpa")]


def ground_truth_logits(model, batch, m, h_new, attention_mask=None):
    """Full forward with a hook that puts h_new in place of h_m (input of layer m+1, or output of layer L)."""
    st = models.structure(model)
    L = st.num_layers
    calls = {"pre": 0, "post": 0}

    def pre(mod, args, kwargs):
        k = calls["pre"]
        calls["pre"] += 1
        if k == m:
            if args:
                return (h_new,) + tuple(args[1:]), kwargs
            return args, {**kwargs, "hidden_states": h_new}
        return None

    def post(mod, args, output):
        k = calls["post"]
        calls["post"] += 1
        if k == L - 1 and m == L:
            return (h_new,) + tuple(output[1:]) if isinstance(output, tuple) else h_new
        return None

    handles = []
    for mod in st.layer_modules:
        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post))
    inputs = models.model_inputs(batch)
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask
    try:
        return model(**inputs).logits
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_structure_finds_the_encoder_layers(arch):
    model = tiny_model(arch, num_layers=3)
    st = models.structure(model)
    assert st.layer_list_name == LAYER_LISTS[arch]
    assert st.num_layers == 3
    assert st.task == "sequence_classification"
    assert len(st.layer_modules) == (1 if arch == "albert" else 3)  # ALBERT: one shared group, called 3 times


@pytest.mark.parametrize("arch,attn", CASES)
def test_capture_is_hidden_states_and_resume_reproduces_logits(arch, attn):
    model = tiny_model(arch, attn=attn).eval()
    batch = tiny_batch(arch)
    with torch.no_grad():
        ref = model(**models.model_inputs(batch), output_hidden_states=True)
        for m in range(models.num_layers(model) + 1):
            cap = models.capture(model, batch, m)
            torch.testing.assert_close(cap.hidden, ref.hidden_states[m], atol=1e-6, rtol=0)
            torch.testing.assert_close(cap.outputs.logits, ref.logits, atol=1e-6, rtol=0)
            out = models.resume(model, cap, cap.hidden.clone())
            torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch,attn", CASES)
def test_resume_on_a_mixture_equals_hooked_full_forward(arch, attn):
    model = tiny_model(arch, attn=attn).eval()
    batch = tiny_batch(arch)
    perm = torch.tensor([2, 3, 1, 0])
    lam = torch.tensor([0.3, 0.7, 0.5, 0.9]).view(-1, 1, 1)
    with torch.no_grad():
        for m in range(models.num_layers(model) + 1):
            cap = models.capture(model, batch, m)
            h_mix = lam * cap.hidden[perm] + (1 - lam) * cap.hidden
            got = models.resume(model, cap, h_mix).logits
            want = ground_truth_logits(model, batch, m, h_mix)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            assert (got - cap.outputs.logits).abs().max() > 1e-4  # the mixture matters
            if m >= 1:  # union mask: the model builds its own extended mask from the 2-D mask we pass
                mask = batch["attention_mask"]
                union = (mask.bool() | mask[perm].bool()).long()
                got_u = models.resume(model, cap, h_mix, attention_mask=union).logits
                want_u = ground_truth_logits(model, batch, m, h_mix, attention_mask=union)
                torch.testing.assert_close(got_u, want_u, atol=1e-5, rtol=0)
                if m < models.num_layers(model):  # layers after m see the mask: it is really used
                    assert (got_u - got).abs().max() > 1e-6


def test_resume_skips_embeddings_and_lower_layers():
    model = tiny_model("bert", num_layers=3).eval()
    batch = tiny_batch("bert")
    calls = []
    watched = {"emb": model.bert.embeddings.word_embeddings, "l0": model.bert.encoder.layer[0].attention,
               "l1": model.bert.encoder.layer[1].attention, "l2": model.bert.encoder.layer[2].attention}
    for name, mod in watched.items():
        mod.register_forward_hook(lambda *a, name=name: calls.append(name))
    cap = models.capture(model, batch, 2)
    assert calls == ["emb", "l0", "l1", "l2"]
    calls.clear()
    models.resume(model, cap, cap.hidden)
    assert calls == ["l2"]


@pytest.mark.parametrize("arch", ["bert", "deberta-v2"])
def test_train_mode_resume_uses_the_same_dropout_masks(arch):
    model = tiny_model(arch, hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3).train()
    batch = tiny_batch(arch)
    torch.manual_seed(0)
    cap = models.capture(model, batch, 1)
    state = torch.get_rng_state()
    same = models.resume(model, cap, cap.hidden).logits
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG stream is left as it was
    torch.testing.assert_close(same, cap.outputs.logits, atol=1e-6, rtol=0)
    other = models.resume(model, cap, cap.hidden, same_dropout=False).logits
    assert (other - cap.outputs.logits).abs().max() > 1e-4


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_pooled_representation_and_head_logits(arch):
    model = tiny_model(arch).eval()
    batch = tiny_batch(arch)
    with torch.no_grad():
        cap = models.capture(model, batch, 0, pooled=True)
        assert cap.pooled.shape == (4, 32)
        torch.testing.assert_close(models.head_logits(model, cap, cap.pooled), cap.outputs.logits, atol=1e-6, rtol=0)
        moved = models.head_logits(model, cap, cap.pooled + 1.0)
        assert (moved - cap.outputs.logits).abs().max() > 1e-4
        ref = model(**models.model_inputs(batch), output_hidden_states=True)
        if arch == "bert":
            torch.testing.assert_close(cap.pooled, model.bert.pooler(ref.hidden_states[-1]))
        if arch in ("roberta", "electra"):  # the head takes the sequence: first-token row
            torch.testing.assert_close(cap.pooled, ref.hidden_states[-1][:, 0])


def test_pooled_gradient_is_the_head_input_gradient():
    model = tiny_model("roberta").eval()
    cap = models.capture(model, tiny_batch("roberta"), 0, pooled=True)
    x = cap.pooled.detach().requires_grad_(True)
    (want,) = torch.autograd.grad(models.head_logits(model, cap, x)[:, 1].sum(), x)
    got = models.grad_wrt_pooled(cap.outputs.logits[:, 1].sum(), cap, create_graph=False)
    torch.testing.assert_close(got, want)


def test_question_answering_model_resumes_exactly():
    model = tiny_model("bert", task="qa").eval()
    batch = tiny_batch("bert")
    st = models.structure(model)
    assert st.task == "question_answering" and st.head_name == "qa_outputs"
    with torch.no_grad():
        cap = models.capture(model, batch, 2)
        s, e = models.logits_of(models.resume(model, cap, cap.hidden))
        torch.testing.assert_close(s, cap.outputs.start_logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(e, cap.outputs.end_logits, atol=1e-5, rtol=0)


def test_decoder_only_model_is_refused_with_a_clear_error():
    model = tiny_model("gpt2", num_layers=2)
    with pytest.raises(ValueError, match=r"GPT2ForSequenceClassification.*(decoder|causal)"):
        models.structure(model)


def test_gradient_checkpointing_is_refused():
    model = tiny_model("bert")
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    with pytest.raises(ValueError, match="gradient checkpointing"):
        models.capture(model, tiny_batch("bert"), 1)


def test_layer_out_of_range_is_refused():
    model = tiny_model("bert", num_layers=3)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 3\]"):
        models.capture(model, tiny_batch("bert"), 4)


# ----------------------------------------------------------------------------- first-token last layer


@pytest.mark.parametrize("arch", ["bert", "roberta", "electra", "distilbert"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_first_token_last_layer_gives_the_full_logits_and_gradients(arch, attn):
    model = tiny_model(arch, attn=attn, dtype=torch.float64).eval()
    batch = tiny_batch(arch, batch=5)
    for m in range(3):
        cap = models.capture(model, batch, m)
        assert models.first_token_ok(model, cap)
        union = batch["attention_mask"] | batch["attention_mask"].flip(0)
        for mask in (None, union):
            h = cap.hidden.detach().clone().requires_grad_(True)
            full = models.resume(model, cap, h, attention_mask=mask).logits
            (g_full,) = torch.autograd.grad(full.square().sum(), h)
            pruned = models.resume(model, cap, h, attention_mask=mask, first_token=True).logits
            (g_pruned,) = torch.autograd.grad(pruned.square().sum(), h)
            torch.testing.assert_close(pruned, full, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(g_pruned, g_full, rtol=1e-10, atol=1e-12)
            # the head handed one row (CAT's and GS's passes): the same logits and input gradient
            out = models.resume(model, cap, h, attention_mask=mask, first_token=True, first_token_row_only=True)
            (g_row,) = torch.autograd.grad(out.logits.square().sum(), h)
            torch.testing.assert_close(out.logits, full, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(g_row, g_full, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("arch", ["bert", "distilbert"])
def test_first_token_last_layer_computes_row_zero_only(arch):
    model = tiny_model(arch, dtype=torch.float64).eval()
    batch = tiny_batch(arch)
    cap = models.capture(model, batch, 1)
    out = models.resume(model, cap, cap.hidden, first_token=True, first_token_fill=float("nan"))
    assert torch.isfinite(out.logits).all()  # the head reads row 0 only
    seen = {}
    last = models.structure(model).layer_modules[-1]
    query = last.attention.q_lin if arch == "distilbert" else last.attention.self.query
    handle = query.register_forward_hook(lambda mod, args, out: seen.update(rows=args[0].shape[1]))
    try:
        models.resume(model, cap, cap.hidden, first_token=True)
    finally:
        handle.remove()
    assert seen["rows"] == 1


def test_first_token_is_refused_for_heads_that_read_other_rows():
    class MeanPooledBertForSequenceClassification(transformers.BertForSequenceClassification):
        def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, **kwargs):
            h = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids).last_hidden_state
            pooled = (h * attention_mask[..., None]).sum(1) / attention_mask.sum(1, keepdim=True)
            return transformers.modeling_outputs.SequenceClassifierOutput(logits=self.classifier(pooled))

    torch.manual_seed(0)
    model = MeanPooledBertForSequenceClassification(tiny_config("bert")).eval()
    assert not models.first_token_ok(model, models.capture(model, tiny_batch("bert"), 1))
    qa = tiny_model("bert", task="qa").eval()
    assert not models.first_token_ok(qa, models.capture(qa, tiny_batch("bert"), 1))


def test_first_token_check_waits_for_a_capture_below_the_last_layer():
    model = tiny_model("bert").eval()
    assert not models.first_token_ok(model, models.capture(model, tiny_batch("bert"), 3))
    assert models.first_token_ok(model, models.capture(model, tiny_batch("bert"), 2))


@pytest.mark.parametrize("arch", ["bert", "roberta", "electra", "distilbert"])
def test_pruned_clean_forward_gives_the_full_logits_and_gradients(arch):
    # capture(first_token=True) and first_token_forward: the same logits and parameter gradients as the model's
    # own forward (float64); rows 1.. of the pruned last layer's output are its input rows.
    model = tiny_model(arch, dtype=torch.float64).eval()
    batch = tiny_batch(arch, batch=5)
    assert models.first_token_ready(model, batch)
    params = [p for p in model.parameters() if p.requires_grad]

    def logits_and_grads(out):
        logits = out.logits
        return logits, torch.autograd.grad(logits.square().sum(), params, allow_unused=True)

    full, g_full = logits_and_grads(model(**models.model_inputs(batch)))
    cap = models.capture(model, batch, 1, first_token=True)
    forward_out = models.first_token_forward(model, batch)
    for out in (cap.outputs, forward_out):
        logits, grads = logits_and_grads(out)
        torch.testing.assert_close(logits, full, rtol=1e-12, atol=1e-12)
        for g, want in zip(grads, g_full):
            assert (g is None) == (want is None)
            if g is not None:
                torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)
    layer_input = models.capture(model, batch, 2).hidden
    torch.testing.assert_close(models.patching.first_of(cap.last_output)[:, 1:], layer_input[:, 1:], rtol=0, atol=0)


def test_pruned_clean_forward_is_skipped_where_it_would_change_outputs():
    model = tiny_model("bert").eval()
    batch = tiny_batch("bert")
    assert models.first_token_ready(model, batch)
    want = model(**models.model_inputs(batch), output_hidden_states=True).hidden_states[-1]
    got = models.first_token_forward(model, dict(batch, output_hidden_states=True)).hidden_states[-1]
    torch.testing.assert_close(got, want)  # every row of the last layer is returned whole
    last = models.capture(model, batch, 3, first_token=True).hidden  # m = L: h_L is the whole last layer
    torch.testing.assert_close(last, want)
    albert = tiny_model("albert").eval()
    assert not models.first_token_ready(albert, tiny_batch("albert"))
    torch.testing.assert_close(models.first_token_forward(albert, tiny_batch("albert")).logits,
                               albert(**models.model_inputs(tiny_batch("albert"))).logits)


def test_first_token_check_draws_no_random_numbers_and_keeps_train_mode():
    model = tiny_model("bert", hidden_dropout_prob=0.3).train()
    state = torch.get_rng_state()
    assert models.first_token_ready(model, tiny_batch("bert"))
    assert torch.equal(torch.get_rng_state(), state)
    assert all(mod.training for mod in model.modules())


@pytest.mark.parametrize("arch", ["bert", "distilbert"])
def test_pruned_resume_replays_the_pruned_clean_forward_dropout(arch):
    # Train mode with dropout: resuming a pruned capture on h_m itself with the pruned last layer draws the clean
    # forward's masks in every layer, the last one included: the same logits bit for bit.
    model = tiny_model(arch, hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3, dropout=0.3,
                       attention_dropout=0.3).train()
    batch = tiny_batch(arch)
    assert models.first_token_ready(model, batch)
    cap = models.capture(model, batch, 1, first_token=True)
    again = models.resume(model, cap, cap.hidden.detach(), first_token=True).logits
    assert torch.equal(again, cap.outputs.logits)
    other = models.capture(model, batch, 1, first_token=True).outputs.logits
    assert not torch.equal(other, cap.outputs.logits)  # dropout is on: another forward draws other masks


SDPA_ARCHS = [a for a in TINY_ARCHS if a != "deberta-v2"]  # DeBERTa-v2 has eager attention only


def _grads(model, logits):
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(logits.sum(), params, allow_unused=True, retain_graph=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)])


@pytest.mark.parametrize("arch", SDPA_ARCHS)
@pytest.mark.parametrize("task", ["cls", "qa"])
def test_sync_free_inputs_give_the_models_own_outputs_and_gradients(arch, task):
    # The 4-D SDPA mask given in place of the 2-D one: the model's own logits and parameter gradients.
    model = tiny_model(arch, task=task, attn="sdpa", dtype=torch.float64).eval()
    inputs = models.model_inputs(tiny_batch(arch))
    assert bool((inputs["attention_mask"] == 0).any())  # a padded batch
    converted = models.sync_free_inputs(model, inputs)
    assert inputs["attention_mask"].dim() == 2 and converted["attention_mask"].shape == (4, 1, 9, 9)
    got, want = models.logits_of(model(**converted)), models.logits_of(model(**inputs))
    if task == "cls":
        got, want = (got,), (want,)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(_grads(model, a), _grads(model, b), rtol=1e-12, atol=1e-12)
    cap = models.capture(model, inputs, 1)
    assert cap.inputs["attention_mask"].dim() == 4 and torch.equal(cap.padding_mask, inputs["attention_mask"])


def test_sync_free_inputs_keep_the_2d_mask_where_the_model_needs_it():
    eager = tiny_model("bert", attn="eager")
    inputs = models.model_inputs(tiny_batch("bert"))
    assert models.sync_free_inputs(eager, inputs) is inputs  # eager attention builds an additive float mask
    deberta = tiny_model("deberta-v2", dtype=torch.float64)
    deberta.config._attn_implementation = "sdpa"  # its embeddings multiply by the 2-D mask: the check refuses
    d_inputs = models.model_inputs(tiny_batch("deberta-v2"))
    assert models.sync_free_inputs(deberta, d_inputs) is d_inputs and models.inputs._MASK_4D[deberta] is False
    no_mask = {k: v for k, v in inputs.items() if k != "attention_mask"}
    assert models.sync_free_inputs(tiny_model("bert", attn="sdpa"), no_mask) is no_mask


def test_a_model_that_pads_inside_its_forward_is_refused_with_the_fix():
    """Longformer pads to a multiple of attention_window inside its forward: h_m no longer matches the batch."""
    cfg = transformers.LongformerConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, max_position_embeddings=80, attention_window=8,
                                        num_labels=2, pad_token_id=1)
    torch.manual_seed(0)
    model = transformers.LongformerForSequenceClassification(cfg).eval()
    odd = {"input_ids": torch.randint(3, 100, (2, 13)), "attention_mask": torch.ones(2, 13, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"pads the sequence inside its forward \(13 tokens in the batch, 16 at "
                                         r"layer 1.*pad_to_multiple_of"):
        models.capture(model, odd, 1)
    even = {"input_ids": torch.randint(3, 100, (2, 16)), "attention_mask": torch.ones(2, 16, dtype=torch.long)}
    cap = models.capture(model, even, 1)
    assert cap.hidden.shape[1] == 16
