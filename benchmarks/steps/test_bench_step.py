"""Step-level benchmarks: one training step of BERT-base (random weights, `BertConfig()` defaults, num_labels=2).

bf16 autocast, AdamW (fused on CUDA), B x T = 8x128, 32x128, 64x256; each sample's length is drawn in
[T/2, T] (the rest is padding). Methods (every step = forward, loss, backward, optimizer step, zero_grad):

1. `plain`       fine-tuning: CE on the logits (SDPA attention).
1f. `plain_first_token` the same through `cat_fast.models.first_token_forward` (the last layer for the first
                 token only, as every pass of `cat` and of the GS methods but `gs_exact` runs it): what the
                 first-token cut alone gives a plain step, so CAT's ratio to it is shown too.
1t. `plain_training_layers` the same with `training_layers=True` (the other layers as `cat_fast.layers.training`,
                 as the GS pooled clean forward runs them): what the host-light layer gives a plain step.
2. `naive_cat`   SPEC §1 written directly in eager PyTorch with `cat_fast.kernels.reference` ops: lower layers once
                 with output_hidden_states, h_m = hidden_states[9]; layers 10..12 + pooler + classifier called
                 directly with the model's own (SDPA) mask; 3 CAL steps with torch.autograd.grad w.r.t. lambda
                 only; final counterfactual forward without autograd (detached CRM weight); loss = ERM + CRM.
3. `cat`         `cat_fast.CAT(model, layers=[8, 9, 10], adv_steps=3)` (CAL loop replayed as CUDA graphs).
3e. `cat_eager`  the same with `cuda_graph=False` (the eager CAL loop), for the graphs' effect side by side.
3f. `cat_full_last` the same (CUDA graphs) with `prune_last_layer=False`: layer L run whole in every pass, for
                 the first-token last layer's effect side by side.
3h. `cat_hf_layers` the same (CUDA graphs) with `fast_resume=False`: the counterfactual passes run the model's own
                 layers instead of `cat_fast.layers.resumed`, for its effect side by side.
3c. `cat_hf_clean` the same (CUDA graphs) with `training_layers=False` (the model's own layers in the clean
                 forward; `cat` runs them as `cat_fast.layers.training`), for its effect side by side.
4. `gs_exact`    `GradientSupervision(representation=0, mode="exact")` (token level, embedding output), eager
                 attention (double backward), pairs = a random permutation.
5. `gs_first_order` the same with mode="first_order" and SDPA attention (SPEC's central difference, 2 passes).
5f. `gs_first_order_fwd` the same with difference="forward" (one perturbed pass; the clean pass is reused).
6. `gs_pooled`   `GradientSupervision(representation="pooled", mode="exact")` (the paper's text setting);
                 SDPA (the double backward only crosses the head); falls back to eager if SDPA refuses. Its clean
                 forward runs `cat_fast.layers.training` (GS's default `training_layers=True`).
6h. `gs_pooled_hf_layers` the same with `training_layers=False`: the model's own layers, for the training
                 layer's effect side by side.
7. `poe`, `reweight`, `learned_mixin`, `conf_reg`: the bias-model objectives of `cat_fast.objectives.debias`
                 (`PoE`, `Reweight`, `LearnedMixin` with its gate in the optimizer, `ConfidenceRegularization`) with
                 a fixed bias [B, C] (log-probabilities) and teacher probabilities in the batch, as the CLI's
                 batches carry them; their forward is `plain_first_token`'s (learned-mixin also captures the
                 pooled vector for its gate), so `plain_first_token` is their ERM step.
9. `plain_compiled`, `plain_compiled_ro`: `plain` with `torch.compile(model)` (default mode) and
                 `torch.compile(model, mode="reduce-overhead")` (CUDA graphs; the fused AdamW step stays eager): the
                 baseline a performance-minded user compares against. The first step (the compilation)
                 is timed apart as `compile_s`; GPU only (the CPU smoke run skips them).
10. `plain_captured`: `cat_fast.step.CapturedStep(ERM(model), ...)`: the model's own loss, backward and a fused,
                 capturable AdamW (tensor lr) as one hand-captured CUDA graph per batch shape (on the CPU
                 the same step eagerly).
10f. `plain_fast_captured`: the same with `ERM(model, fast=True)`: `first_token_forward` with the training layers
                 (`plain_training_layers`' forward), cat_fast's fast plain step, as one CUDA graph per shape.
11. `cat_captured`: `cat`'s CAT through `CapturedStep` with that optimizer: the whole step (clean forward, CAL
                 loop, final pass, backward, AdamW) as one CUDA graph per mixing layer. Its graphs are captured
                 before the warm-up (one eager step and the capture per layer), timed apart as `capture_s`.
12. `gs_first_order_fwd_captured`, `gs_pooled_captured`: `gs_first_order_fwd` (with ``low_memory=False``, which a
                 captured step needs) and `gs_pooled` through `CapturedStep` with that optimizer: one CUDA graph per
                 batch shape, captured within the warm-up.
13. `gs_exact_captured`, `poe_captured`, `reweight_captured`, `learned_mixin_captured`, `conf_reg_captured`,
                 `clp_captured`: `gs_exact`, the bias-model objectives and `clp` through `CapturedStep` the same way
                 (learned-mixin's gate in that optimizer; CLP's virtual step at its tensor learning rate), so that
                 every objective has a row against `plain_compiled_ro`.
8. `clp`, `clp_all`: `cat_fast.CLP` (causal logit perturbation) with `virtual="head"` / `"all"`: the model's own
                 forward (so `plain` is their ERM step), the characteristics op, Ω's meta step on a metadata batch
                 of the same shape (another draw of ids), the perturbed loss; `clp_all` runs eager attention (its
                 virtual step back-propagates twice through every layer).

Timing: >= 5 warm-up steps, then CUDA events around each of <= 25 timed steps (CAT_FAST_BENCH_STEP_WARMUP,
CAT_FAST_BENCH_STEP_STEPS; defaults 5 and 20), median reported. Then, for every method but plain, a paired
measurement: a plain SDPA step on its own model is built beside it and the two are timed interleaved (20 rounds
of blocks of 2 steps each, the order flipped every round, after warm-up: twice the timed steps of each, in steady
state: CUDA events around every step, one synchronisation at the end); `paired_ratio` = median method / median
plain of that pair. CAT draws its mixing layer m from {8, 9, 10} at every step, and a step at m = 8 resumes twice
the layers of one at m = 10, so its step times form three modes: the CAT cases also record the median step per
drawn layer (`step_by_layer`, `paired_by_layer`: {m: [median ms, calls]}) and their mean over the layers
(`paired_layer_ratio` = that mean / the paired plain median: the expected cost of a step, as the FLOP count's mean
m), which does not jump between modes with the draws that land in the timed window as the median does. Peak
memory: torch.cuda.max_memory_allocated over the timed steps (stats reset after warm-up; includes weights, grads
and AdamW state). Errors and OOM are recorded per case (extra_info["error"]) and do not stop the run. FLOPs of
plain and CAT from the config (see `model_flops`).
`test_cat_host_sync` runs one CAT step (and, for attribution, one plain step) under
torch.cuda.set_sync_debug_mode("error") and records whether it raised.

CAT_FAST_BENCH_STEP_CPU=1 runs the same code on CPU with a tiny BERT (a smoke test of the benchmark code, no
meaningful numbers).
"""
import gc
import os
import statistics
import time

import pytest
import torch
import torch.nn.functional as F

from benchmarks import _harness as H

pytestmark = [pytest.mark.benchmark(timer=H.virtual_clock), pytest.mark.bench_step]

METHODS = ("plain", "plain_first_token", "plain_training_layers", "naive_cat", "cat", "cat_eager", "cat_full_last",
           "cat_hf_layers", "cat_hf_clean", "gs_exact", "gs_first_order", "gs_first_order_fwd", "gs_pooled",
           "gs_pooled_hf_layers", "poe", "reweight", "learned_mixin", "conf_reg", "clp", "clp_all",
           "plain_compiled", "plain_compiled_ro", "plain_captured", "plain_fast_captured", "cat_captured",
           "gs_first_order_fwd_captured", "gs_pooled_captured", "gs_exact_captured", "poe_captured",
           "reweight_captured", "learned_mixin_captured", "conf_reg_captured", "clp_captured")
CAPTURED_GS_METHODS = ("gs_first_order_fwd_captured", "gs_pooled_captured")
# the other objectives through CapturedStep: the method without "_captured", one graph per batch shape
CAPTURED_OTHER_METHODS = ("gs_exact_captured", "poe_captured", "reweight_captured", "learned_mixin_captured",
                          "conf_reg_captured", "clp_captured")
COMPILED_METHODS = ("plain_compiled", "plain_compiled_ro")
DEBIAS_METHODS = ("poe", "reweight", "learned_mixin", "conf_reg")
CAT_METHODS = ("cat", "cat_eager", "cat_full_last", "cat_hf_layers", "cat_hf_clean", "cat_captured")
# Methods whose passes run the last layer for the first token only (`prune_last_layer=True`, the default).
FIRST_TOKEN_METHODS = ("plain_first_token", "plain_training_layers", "cat", "cat_eager", "cat_captured", "cat_hf_layers",
                       "cat_hf_clean", "gs_first_order", "gs_first_order_fwd", "gs_pooled", "gs_pooled_hf_layers",
                       "gs_first_order_fwd_captured", "gs_pooled_captured", "plain_fast_captured")
FIRST_TOKEN_METHODS += DEBIAS_METHODS + tuple(m + "_captured" for m in DEBIAS_METHODS)
GS_LONG_METHODS = ("plain", "gs_exact", "gs_first_order", "gs_first_order_fwd")  # the T = 512 size
CAT_LAYERS = [8, 9, 10]
NAIVE_LAYER = 9
ADV_STEPS = 3
ALPHA = BETA = 0.3
GAMMA, ETA, ADV_LR = 10.0, 20.0, 2e-2

CPU_SMOKE = os.environ.get("CAT_FAST_BENCH_STEP_CPU", "0") == "1" and not H.HAS_CUDA


def setting():
    """(device, config kwargs, sizes, GS long-sequence size, mixing layers, naive layer, warm-up, timed steps)."""
    if CPU_SMOKE:
        config = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                      vocab_size=2000, max_position_embeddings=64)
        return "cpu", config, ("2x16", "4x32"), "2x64", [2, 3], 3, 1, 2
    warmup = max(1, H.env_int("CAT_FAST_BENCH_STEP_WARMUP", 5))
    steps = min(25, max(1, H.env_int("CAT_FAST_BENCH_STEP_STEPS", 20)))
    return "cuda", {}, ("8x128", "32x128", "64x256"), "32x512", CAT_LAYERS, NAIVE_LAYER, warmup, steps


DEVICE, CONFIG, SIZES, LONG_SIZE, LAYERS, NAIVE_M, WARMUP, STEPS = setting()
SKIP = None if (H.HAS_CUDA or CPU_SMOKE) else H.NO_CUDA_REASON + " (CAT_FAST_BENCH_STEP_CPU=1: tiny CPU smoke run)"


# ----------------------------------------------------------------------------- model, batch, FLOPs


def make_config(attn):
    from transformers import BertConfig

    return BertConfig(num_labels=2, attn_implementation=attn, **CONFIG)


def make_model(attn):
    from transformers import BertForSequenceClassification

    with torch.device(DEVICE):
        model = BertForSequenceClassification(make_config(attn))
    if getattr(model.config, "_attn_implementation", attn) != attn:  # older transformers ignore the config kwarg
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(attn)
        else:
            model.config._attn_implementation = attn
    return model.to(DEVICE).train()


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=2e-5, fused=DEVICE == "cuda")


def make_batch(batch, tokens, vocab, device=None, seed=1234):
    """Random ids with lengths in [T/2, T] (the first sample T long), labels alternating in random order, random
    pairs; on `device` (default: the suite's). Also the batch of `benchmarks/tools/ddp_step_bench.py` (per rank)."""
    device = DEVICE if device is None else device
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1000 if vocab > 2000 else 5, vocab, (batch, tokens), generator=gen)
    lengths = torch.randint(tokens // 2, tokens + 1, (batch,), generator=gen)
    lengths[0] = tokens  # the longest sample fills the padded length
    attention_mask = (torch.arange(tokens)[None, :] < lengths[:, None]).long()
    input_ids[:, 0] = 101 if vocab > 2000 else 1
    input_ids = input_ids * attention_mask
    labels = (torch.arange(batch) % 2)[torch.randperm(batch, generator=gen)]
    pairs = torch.randperm(batch, generator=gen)
    out = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    return {k: v.to(device) for k, v in out.items()}, pairs.to(device)


def model_flops(config, batch, tokens, method, m=None, adv_steps=ADV_STEPS, final_backward=False):
    """Matmul FLOPs of one step from the config.

    forward = 2 * (matmul params) * tokens + attention 4 * B * T^2 * D per layer (+ pooler/classifier per sample);
    backward = 2 x forward. CAT adds, per CAL step, a forward of layers m+1..L (+ head) and an input-only
    backward of those (~1 x forward: no weight-gradient matmuls), plus the final counterfactual forward of
    layers m+1..L. The methods in `FIRST_TOKEN_METHODS` run layer L of every pass (clean forward, CAL steps,
    final pass, GS passes) for the first token only (`cat_fast.layers.first_token`, `prune_last_layer`, the
    default: K and V of every token, row 0's Q, attention, attention output and feed-forward); `plain`,
    `naive_cat`, `cat_full_last` and `gs_exact` run it whole. With the default detached CRM weight the final
    counterfactual pass has no backward (the implementations run it without autograd); `final_backward=True`
    counts one anyway (2 x forward more), the issue's formula. First-order GS at h_0 adds g (an input-only backward, ~1 x forward) and per perturbed pass
    a forward and a full backward (3 x forward): 2 passes (central) → 10/3 = 3.33x, 1 pass (forward) → 7/3 = 2.33x
    (of the same method's own forward). Embedding lookups, layer norms, softmax and elementwise work are not
    counted.
    """
    D, I, L, C = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_labels  # noqa: E741
    n_tok = batch * tokens
    layer = 2 * n_tok * (4 * D * D + 2 * D * I) + 4 * batch * tokens * tokens * D
    first_token_layer = 2 * n_tok * 2 * D * D + 2 * batch * (2 * D * D + 2 * D * I) + 4 * batch * tokens * D
    last = first_token_layer if method in FIRST_TOKEN_METHODS else layer
    head = 2 * batch * (D * D + D * C)
    forward = (L - 1) * layer + last + head
    total = 3 * forward
    if method == "naive_cat" or method in CAT_METHODS:
        upper = (L - m - 1) * layer + last + head
        total += adv_steps * 2 * upper + upper * (3 if final_backward else 1)
    if method.startswith("gs_first_order"):  # representation h_0: every pass covers all L layers
        passes = 1 if method.endswith("_fwd") else 2
        total += forward + passes * 3 * forward  # g (input-only backward) + each pass's forward and backward
    if method == "clp":  # + the metadata batch's forward (the virtual step is the head's only)
        total += forward
    if method == "clp_all":  # + the virtual step's backward with create_graph (~2), the metadata forward through the
        total += 7 * forward  # updated parameters (1) and its backward to Ω through the virtual step (~4): approximate
    return total


# ----------------------------------------------------------------------------- the steps


def autocast():
    return torch.autocast(DEVICE, dtype=torch.bfloat16)


def captured_step(objective, model, **kwargs):
    """`cat_fast.step.CapturedStep` of `objective` under bf16 autocast with its own AdamW (fused and capturable,
    a tensor lr, on a GPU) over the model's and the objective's parameters: the `*_captured` rows."""
    from cat_fast.step import CapturedStep

    cuda = DEVICE == "cuda"
    params = list(model.parameters()) + list(objective.parameters())
    own = torch.optim.AdamW(params, lr=torch.tensor(2e-5, device=DEVICE) if cuda else 2e-5, fused=cuda,
                            capturable=cuda)
    objective.set_optimizer(own)
    return CapturedStep(objective, own, autocast=torch.bfloat16, **kwargs)


def debias_objective(method, model, batch):
    """(objective, batch with a fixed bias [B, C] (log-probabilities) and teacher probabilities) of a bias-model
    method, as the CLI's batches carry them."""
    from cat_fast.objectives import debias

    objective = {"poe": debias.PoE, "reweight": debias.Reweight, "learned_mixin": debias.LearnedMixin,
                 "conf_reg": debias.ConfidenceRegularization}[method](model)
    gen = torch.Generator().manual_seed(7)
    shape = (batch["labels"].shape[0], model.config.num_labels)
    return objective, dict(batch, bias=torch.log_softmax(2 * torch.randn(shape, generator=gen), -1).to(DEVICE),
                           teacher_probs=torch.softmax(2 * torch.randn(shape, generator=gen), -1).to(DEVICE))


def metadata_batch(model, batch):
    """CLP's metadata batch: `batch`'s shape, another draw of ids and labels."""
    gen = torch.Generator().manual_seed(11)
    ids = batch["input_ids"]
    return dict(batch, input_ids=torch.randint(0, model.config.vocab_size, tuple(ids.shape), generator=gen).to(ids.device),
                labels=torch.randint(0, model.config.num_labels, tuple(batch["labels"].shape),
                                     generator=gen).to(ids.device))


def make_step(method, model, optimizer, batch, pairs):
    """A closure that runs one training step of `method` (forward, loss, backward, optimizer step)."""
    import cat_fast
    from cat_fast import models

    def finish_step(loss):
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if method == "plain":
        def step():
            with autocast():
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                loss = F.cross_entropy(logits.float(), batch["labels"])
            finish_step(loss)
        return step

    if method in COMPILED_METHODS:
        compiled = torch.compile(model, mode="reduce-overhead" if method == "plain_compiled_ro" else None)

        def step():
            with autocast():
                logits = compiled(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                loss = F.cross_entropy(logits.float(), batch["labels"])
            finish_step(loss)
        return step

    if method in ("plain_captured", "plain_fast_captured"):
        from cat_fast.objectives import ERM

        captured = captured_step(ERM(model, fast=method == "plain_fast_captured"), model)

        def step():
            captured(batch)
        step.captured = captured
        return step

    if method in ("plain_first_token", "plain_training_layers"):
        training_layers = method == "plain_training_layers"

        def step():
            with autocast():
                logits = models.first_token_forward(model, batch, training_layers=training_layers).logits
                loss = F.cross_entropy(logits.float(), batch["labels"])
            finish_step(loss)
        return step

    if method == "naive_cat":
        return naive_cat_step(model, batch, finish_step)

    if method in CAPTURED_OTHER_METHODS:
        base = method[:-len("_captured")]
        args = ()
        if base in DEBIAS_METHODS:
            objective, batch = debias_objective(base, model, batch)
        elif base == "gs_exact":
            objective = cat_fast.GradientSupervision(model, weight=1.0, representation=0, mode="exact")
            args = (pairs,)
        else:  # clp: the virtual step at the captured optimizer's (tensor) learning rate
            from cat_fast.objectives.clp import CLP

            objective = CLP(model, [metadata_batch(model, batch)], virtual="head")
        captured = captured_step(objective, model, warmup_steps=2)

        def step():
            captured(batch, *args)
        step.captured = captured
        return step

    if method in DEBIAS_METHODS:
        objective, batch = debias_objective(method, model, batch)
        if objective.parameters():
            optimizer.add_param_group({"params": objective.parameters()})

        def step():
            with autocast():
                loss, _ = objective(batch)
            finish_step(loss)
        return step

    if method in ("clp", "clp_all"):
        from cat_fast.objectives.clp import CLP

        objective = CLP(model, [metadata_batch(model, batch)], virtual="all" if method == "clp_all" else "head")
        objective.set_optimizer(optimizer)

        def step():
            with autocast():
                loss, _ = objective(batch)
            finish_step(loss)
        return step

    if method == "cat_captured":
        cat = cat_fast.CAT(model, layers=LAYERS, adv_steps=ADV_STEPS, alpha=ALPHA, beta=BETA, gamma=GAMMA, eta=ETA,
                           adv_lr=ADV_LR)
        captured = captured_step(cat, model, warmup_steps=1, max_graphs=len(LAYERS))

        def step():
            _, info = captured(batch)
            step.layers.append(int(info["layer"]))

        def prime():  # until every mixing layer has its graph (at most 20 steps per layer); GPU only
            for _ in range(20 * len(LAYERS) if DEVICE == "cuda" else 0):
                if captured.num_graphs == len(LAYERS):
                    break
                step()
            step.layers.clear()
        step.layers, step.captured, step.prime = [], captured, prime
        return step

    if method in CAT_METHODS:
        cat = cat_fast.CAT(model, layers=LAYERS, adv_steps=ADV_STEPS, alpha=ALPHA, beta=BETA, gamma=GAMMA, eta=ETA,
                           adv_lr=ADV_LR, cuda_graph=method != "cat_eager",
                           prune_last_layer=method != "cat_full_last", fast_resume=method != "cat_hf_layers",
                           training_layers=method != "cat_hf_clean")

        def step():
            with autocast():
                loss, info = cat(batch)
            step.layers.append(int(info["layer"]))  # a CPU tensor: no host sync
            finish_step(loss)
        step.layers = []  # the mixing layer m drawn at each call
        return step

    if method in CAPTURED_GS_METHODS:
        if method == "gs_pooled_captured":
            gs = cat_fast.GradientSupervision(model, weight=1.0, representation="pooled", mode="exact")
        else:
            gs = cat_fast.GradientSupervision(model, weight=1.0, representation=0, mode="first_order",
                                              difference="forward", low_memory=False)
        captured = captured_step(gs, model, warmup_steps=2)

        def step():
            captured(batch, pairs)
        step.captured = captured
        return step

    representation, mode, difference = {
        "gs_exact": (0, "exact", "central"),
        "gs_first_order": (0, "first_order", "central"),
        "gs_first_order_fwd": (0, "first_order", "forward"),
        "gs_pooled": ("pooled", "exact", "central"),
        "gs_pooled_hf_layers": ("pooled", "exact", "central"),
    }[method]
    gs = cat_fast.GradientSupervision(model, weight=1.0, representation=representation, mode=mode,
                                      difference=difference, training_layers=method != "gs_pooled_hf_layers")

    def step():
        with autocast():
            loss, _ = gs(batch, pairs)
        finish_step(loss)
    return step


def build_step(method, size):
    """(model, optimizer, step closure) of `method` at `size` ("BxT"): the model, batch and step the suite times
    (for the diagnostics in `benchmarks/tools/`: `profile_step.py`, `host_timeline.py`, ...)."""
    batch_size, tokens = H.dims(size)
    model = make_model(_attn_for(method))
    optimizer = make_optimizer(model)
    batch, pairs = make_batch(batch_size, tokens, model.config.vocab_size)
    return model, optimizer, make_step(method, model, optimizer, batch, pairs)


def _layer_out(out):
    return out[0] if isinstance(out, tuple) else out


def naive_cat_step(model, batch, finish_step):
    """SPEC §1 Algorithm 1 (summed update), eager PyTorch + cat_fast.kernels.reference ops, no cat_fast machinery."""
    from cat_fast.kernels import reference

    bert = model.bert
    upper_layers = bert.encoder.layer[NAIVE_M:]
    input_ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    B = input_ids.shape[0]
    alpha = torch.full((B,), ALPHA, device=input_ids.device)
    beta = torch.full((B,), BETA, device=input_ids.device)

    def extended_mask(h):
        try:
            from transformers.masking_utils import create_bidirectional_mask

            return create_bidirectional_mask(config=model.config, inputs_embeds=h, attention_mask=mask)
        except ImportError:  # older transformers: additive [B, 1, 1, T] mask
            return model.get_extended_attention_mask(mask, mask.shape, dtype=h.dtype)

    def upper(h, ext):
        for layer in upper_layers:
            h = _layer_out(layer(h, ext))
        return model.classifier(model.dropout(bert.pooler(h)))

    def step():
        with autocast():
            out = bert(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
            logits = model.classifier(model.dropout(out.pooler_output))
            erm = F.cross_entropy(logits.float(), labels)
            h_m = out.hidden_states[NAIVE_M].detach()
            ext = extended_mask(h_m)  # mask_mode "self": the mixed sequence keeps sample i's mask
            partner = torch.randperm(B, device=h_m.device)
            lam = torch.distributions.Beta(alpha, beta, validate_args=False).sample()
            for _ in range(ADV_STEPS):
                lam_var = lam.detach().requires_grad_(True)
                h_mix, _ = reference.cmix(h_m, lam_var, partner)
                objective = reference.cal_objective(upper(h_mix, ext), labels, GAMMA, ETA).sum()
                (grad,) = torch.autograd.grad(objective, lam_var)
                reference.cal_step_(lam, grad, ADV_LR, 1.0, 0.0, 1.0)
            with torch.no_grad():  # detached CRM weight: the counterfactual logits need no graph
                h_mix, _ = reference.cmix(h_m, lam, partner)
                cf_logits = upper(h_mix, ext)
            crm = reference.crm_loss(logits, cf_logits, labels, 0.0, 10.0, True, "mean")
            loss = erm + crm
        finish_step(loss)

    return step


# ----------------------------------------------------------------------------- measurement


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _free():
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


class _HostMark:
    """CPU stand-in for a CUDA timing event."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def _mark():
    return torch.cuda.Event(enable_timing=True) if DEVICE == "cuda" else _HostMark()


def _timed_block(step, n):
    """Milliseconds of each of `n` calls of `step`: CUDA events on the GPU, perf_counter on the CPU."""
    marks = [(_mark(), _mark()) for _ in range(n)]
    for start, end in marks:
        start.record()
        step()
        end.record()
    _sync()
    return [start.elapsed_time(end) for start, end in marks]


def _timed_layers(step, n):
    """(times, layers) of `n` calls: the mixing layer of each call where the step records it (CAT), else None."""
    layers = getattr(step, "layers", None)
    seen = len(layers) if layers is not None else 0
    times = _timed_block(step, n)
    return times, (layers[seen:seen + n] if layers is not None else None)


def by_layer(times, layers):
    """{m: (median ms of the calls that drew m, calls)}, or None when the step draws no layer."""
    if layers is None:
        return None
    groups = {}
    for t, m in zip(times, layers):
        groups.setdefault(m, []).append(t)
    return {m: (statistics.median(ts), len(ts)) for m, ts in sorted(groups.items())}


def layer_mean(per_layer):
    """The mean over the drawn layers of their median step: the expected cost of a step whose layer is drawn
    uniformly (the FLOP count's mean m), without the median of a 3-mode mixture jumping between modes with the
    draws that happened to land in the timed window. None unless every one of LAYERS was drawn."""
    if per_layer is None or sorted(per_layer) != sorted(LAYERS):
        return None
    return statistics.fmean(ms for ms, _ in per_layer.values())


def time_steps(step, warmup, steps):
    for _ in range(warmup):
        step()
    _sync()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, layers = _timed_layers(step, steps)
    peak = torch.cuda.max_memory_allocated() / 2**20 if DEVICE == "cuda" else None
    return statistics.median(times), min(times), peak, by_layer(times, layers)


def time_paired(step, plain_step, warmup, steps, rounds=20):
    """(median of `step`, median of a plain step, `step`'s by_layer), the two interleaved in blocks of
    ``2 * steps // rounds`` steps, the order flipped every round, in steady state: events around every step and
    one synchronisation at the end. The small-batch steps are host-bound, and the host's speed drifts (the same
    plain step read 32 and 23 ms a minute apart in one process on an H100 host): a fine interleave puts the drift
    on both steps alike."""
    for _ in range(warmup):
        plain_step()
        step()
    _sync()
    per_round = max(1, (2 * steps) // rounds)
    layers = getattr(step, "layers", None)
    seen = len(layers) if layers is not None else 0
    marks = {step: [], plain_step: []}
    for r in range(rounds):
        for fn in ((plain_step, step) if r % 2 == 0 else (step, plain_step)):
            for _ in range(per_round):
                start, end = _mark(), _mark()
                start.record()
                fn()
                end.record()
                marks[fn].append((start, end))
    _sync()
    times, plain_times = ([s.elapsed_time(e) for s, e in marks[fn]] for fn in (step, plain_step))
    return (statistics.median(times), statistics.median(plain_times),
            by_layer(times, layers[seen:] if layers is not None else None))


def _attn_for(method):
    return "eager" if method in ("gs_exact", "gs_exact_captured", "clp_all") else "sdpa"


def measure_step(method, size):
    batch_size, tokens = H.dims(size)

    def measure():
        _free()
        attn = _attn_for(method)
        extra = {"method": method, "size": size, "batch": batch_size, "tokens_per_sample": tokens,
                 "tokens": batch_size * tokens, "attn": attn, "warmup_steps": WARMUP, "timed_steps": STEPS,
                 "device": DEVICE}
        model = optimizer = step = None
        try:
            model = make_model(attn)
            optimizer = make_optimizer(model)
            batch, pairs = make_batch(batch_size, tokens, model.config.vocab_size)
            step = make_step(method, model, optimizer, batch, pairs)
            if method in COMPILED_METHODS:  # the compilation, timed apart (the warm-up then runs compiled steps)
                _sync()
                start = time.perf_counter()
                step()
                _sync()
                extra["compile_s"] = time.perf_counter() - start
            if hasattr(step, "prime"):  # cat_captured: its graphs, captured before the warm-up and timed apart
                _sync()
                start = time.perf_counter()
                step.prime()
                _sync()
                extra["capture_s"] = time.perf_counter() - start
            try:
                median_ms, min_ms, peak, per_layer = time_steps(step, WARMUP, STEPS)
            except RuntimeError as error:
                if not method.startswith("gs_pooled") or "double backward" not in str(error):
                    raise
                # the pooled GS double backward crossed SDPA after all: measure with eager attention
                model = optimizer = step = None
                _free()
                attn = extra["attn"] = "eager"
                extra["note"] = f"sdpa refused ({str(error)[:120]}); eager attention"
                model = make_model(attn)
                optimizer = make_optimizer(model)
                step = make_step(method, model, optimizer, batch, pairs)
                median_ms, min_ms, peak, per_layer = time_steps(step, WARMUP, STEPS)
            config = model.config
            extra["attn"] = getattr(config, "_attn_implementation", attn)
            if method != "plain":  # paired timing against a plain SDPA step built beside it
                plain_model = make_model("sdpa")
                plain_opt = make_optimizer(plain_model)
                plain_step = make_step("plain", plain_model, plain_opt, batch, pairs)
                paired_ms, plain_ms, paired_layers = time_paired(step, plain_step, WARMUP, STEPS)
                extra.update(paired_step_ms=paired_ms, paired_plain_ms=plain_ms, paired_ratio=paired_ms / plain_ms)
                if paired_layers is not None:
                    extra["paired_by_layer"] = {str(m): v for m, v in paired_layers.items()}
                    mean = layer_mean(paired_layers)
                    if mean is not None:
                        extra.update(paired_layer_mean_ms=mean, paired_layer_ratio=mean / plain_ms)
                plain_model = plain_opt = plain_step = None
            extra.update(step_ms=median_ms, step_min_ms=min_ms, peak_mib=peak,
                         tokens_per_s=batch_size * tokens / (median_ms * 1e-3))
            if hasattr(step, "captured"):  # the *_captured rows: graphs captured (0: every step ran eagerly)
                extra["captured_graphs"] = step.captured.num_graphs
            if per_layer is not None:
                extra["step_by_layer"] = {str(m): v for m, v in per_layer.items()}
                mean = layer_mean(per_layer)
                if mean is not None:
                    extra["step_layer_mean_ms"] = mean
            flop_method = method[:-len("_captured")] if method in CAPTURED_OTHER_METHODS + CAPTURED_GS_METHODS else method
            if flop_method in ("plain", "naive_cat", "plain_captured", "clp") + CAT_METHODS \
                    + FIRST_TOKEN_METHODS + COMPILED_METHODS:
                m = NAIVE_M if method == "naive_cat" else sum(LAYERS) / len(LAYERS)
                extra["flops"] = model_flops(config, batch_size, tokens, flop_method, m)
                extra["flops_final_backward"] = model_flops(config, batch_size, tokens, flop_method, m,
                                                            final_backward=True)
                extra["flops_plain"] = model_flops(config, batch_size, tokens, "plain")
                extra["flop_ratio"] = extra["flops"] / extra["flops_plain"]
                extra["flop_ratio_final_backward"] = extra["flops_final_backward"] / extra["flops_plain"]
                extra["tflops_per_s"] = extra["flops"] / (median_ms * 1e-3) / 1e12
            return median_ms * 1e-3, extra
        finally:
            model = optimizer = step = None
            _free()

    return measure


def _param(method, size):
    marks = [pytest.mark.skip(reason=SKIP)] if SKIP else []
    if CPU_SMOKE and method in COMPILED_METHODS:
        marks = [pytest.mark.skip(reason="torch.compile rows: GPU only (minutes of CPU compilation in a smoke run)")]
    return pytest.param(method, size, id=f"{size}-{method}", marks=marks)


@pytest.mark.parametrize("method,size", [_param(method, size) for size in SIZES for method in METHODS]
                         + [_param(method, LONG_SIZE) for method in GS_LONG_METHODS])
def test_step(benchmark, method, size):
    if not CPU_SMOKE and H.deadline_passed("step"):
        pytest.skip("time budget for step benchmarks exhausted")
    info = H.record(benchmark, measure_step(method, size), group=f"step {size}", method=method, size=size)
    H.finish(info)


# ----------------------------------------------------------------------------- host-sync check


def _sync_check(fn):
    """None if fn() ran without a host synchronisation under set_sync_debug_mode("error"), else the message."""
    if DEVICE != "cuda":
        fn()
        return "not checked (no CUDA)"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return None
    except Exception as error:  # the sync itself raises a RuntimeError
        return H._describe(error)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def measure_sync(size):
    batch_size, tokens = H.dims(size)

    def measure():
        import cat_fast

        _free()
        model = make_model("sdpa")
        optimizer = make_optimizer(model)
        batch, pairs = make_batch(batch_size, tokens, model.config.vocab_size)
        cat = cat_fast.CAT(model, layers=LAYERS, adv_steps=ADV_STEPS)
        plain_step = make_step("plain", model, optimizer, batch, pairs)
        cat_step = make_step("cat", model, optimizer, batch, pairs)
        for _ in range(2):  # first calls: lazy initialisation, Triton JIT, cuBLAS handles
            plain_step()
            cat_step()
        _sync()

        def plain_fb(inputs):
            def run():
                with autocast():
                    logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
                    loss = F.cross_entropy(logits.float(), inputs["labels"])
                loss.backward()
            return run

        def cat_fb(inputs):
            def run():
                with autocast():
                    loss, _ = cat(inputs)
                loss.backward()
            return run

        # Hugging Face's SDPA mask creation itself syncs on a padded batch (`padding_mask.all()` in
        # transformers.masking_utils), so CAT is also checked on a batch without attention_mask (no padding).
        no_mask = {k: v for k, v in batch.items() if k != "attention_mask"}
        for inputs in (batch, no_mask):  # capture this CAT's CUDA graphs (capturing synchronises) before checking
            cat_fb(inputs)()
            optimizer.zero_grad(set_to_none=True)
        _sync()
        extra = {"size": size, "device": DEVICE}
        for name, fn in (("sync_plain", plain_fb(batch)), ("sync_cat", cat_fb(batch)),
                         ("sync_plain_nomask", plain_fb(no_mask)), ("sync_cat_nomask", cat_fb(no_mask))):
            extra[name] = _sync_check(fn)
            optimizer.zero_grad(set_to_none=True)
            extra[name + "_raised"] = None if DEVICE != "cuda" else extra[name] is not None
        model = optimizer = cat = None  # the closures above hold them
        _free()
        return 0.0, extra

    return measure


@pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
def test_cat_host_sync(benchmark):
    size = SIZES[0]
    info = H.record(benchmark, measure_sync(size), group="host sync", method="cat_sync_check", size=size)
    H.finish(info)
    if info.get("sync_cat_nomask_raised"):
        import warnings

        warnings.warn(f"CAT step synchronises with the host: {info.get('sync_cat_nomask')}")
