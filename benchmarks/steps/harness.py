"""The step benchmarks' model, batch and step builders, for the suite (`test_bench_step.py`) and the diagnostics in
`benchmarks/tools/`: ``model, optimizer, step = build_step("cat", "8x128")``, then ``step()`` runs one training step
(forward, loss, backward, optimizer step, zero_grad) under bf16 autocast on the suite's model and batch.

Every row of `METHODS` is a `Method`: a registered objective (``cat_fast.objectives.build(name, model,
**kwargs)``) stepped eagerly or through `cat_fast.step.CapturedStep`, or one of the hand-written plain steps:

1. `plain`: CE on the model's logits (SDPA attention). 1f. `plain_first_token`: the same through
   `cat_fast.models.first_token_forward` (the last layer for the first token only, as every pass of `cat` and of the
   GS methods but `gs_exact` runs it). 1t. `plain_training_layers`: that with ``training_layers=True`` (the other
   layers as `cat_fast.layers.training`, as the GS pooled clean forward runs them).
2. `naive_cat`: docs/METHODS.md §1 written directly in eager PyTorch (`benchmarks/steps/naive_cat.py`).
3. `cat`: ``cat`` with ``layers=[8, 9, 10]``, 3 CAL steps (replayed as CUDA graphs); 3e. `cat_eager`
   (``cuda_graph=False``), 3f. `cat_full_last` (``prune_last_layer=False``), 3h. `cat_hf_layers`
   (``fast_resume=False``), 3c. `cat_hf_clean` (``training_layers=False``): each option's effect side by side.
4. `gs_exact`: ``gs`` at the embedding output (``representation=0``), exact (eager attention, double backward),
   pairs = a random permutation; 4d. `gs_exact_fused`: the same on `cat_fast.layers.double_layers` (attention,
   LayerNorm and GELU; the model loaded with SDPA; GS's default on CUDA). 5. `gs_first_order`
   (``mode="first_order"``, SDPA, ``difference="central"``); 5f. `gs_first_order_fwd` (``difference="forward"``,
   the default). 6. `gs_pooled` (``representation="pooled"``, exact, SDPA: the double backward only crosses the
   head; eager if SDPA refuses); 6h. `gs_pooled_hf_layers` (``training_layers=False``).
7. `poe`, `reweight`, `learned_mixin`, `conf_reg`: the bias-model objectives with a fixed bias [B, C]
   (log-probabilities) and teacher probabilities in the batch, as the CLI's batches carry them (learned-mixin's gate
   in the optimizer); their forward is `plain_first_token`'s, so that is their ERM step.
8. `clp`, `clp_all`: ``clp`` / ``clp-all`` with a metadata batch of the same shape (another draw of ids);
   `clp_all` runs eager attention (its virtual step back-propagates twice through every layer).
9. `plain_compiled`, `plain_compiled_ro`: `plain` with ``torch.compile(model)`` (default mode, and
   ``mode="reduce-overhead"``: CUDA graphs; the fused AdamW step stays eager). GPU only.
10. `plain_captured`, `plain_fast_captured`: ``erm`` (``fast=True``: the first-token cut and the training layers)
   through `CapturedStep` with a fused, capturable AdamW (tensor lr): one CUDA graph per batch shape.
11. `cat_captured`: `cat` through `CapturedStep`, one graph per mixing layer, captured before the warm-up (`prime`).
12./13. `gs_first_order_captured`, `gs_first_order_fwd_captured` (``low_memory=False``, which a captured step
   needs), `gs_pooled_captured`,
   `gs_exact_captured`, `gs_exact_fused_captured`, `poe_captured`, `reweight_captured`, `learned_mixin_captured`,
   `conf_reg_captured`, `clp_captured`: the same objectives through `CapturedStep` (CLP's virtual step at its
   tensor learning rate).
On a GPU the captured steps (10.-13.) are given their batch as pinned CPU tensors (`HOST_BATCHES`), as a
``DataLoader(pin_memory=True)`` yields it, and move it themselves (the copies are in their time; the compiled peer's
batch is on the device already): a packed step reads its row count from the host mask, without a host
synchronisation.
"""
import functools
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.nn.functional as F

from benchmarks import _harness as H
from benchmarks.steps.setting import ADV_LR, ADV_STEPS, ALPHA, BETA, CONFIG, DEVICE, ETA, GAMMA, LAYERS, autocast


@dataclass(frozen=True)
class Method:
    """How a row builds its step.

    ``objective``: a registered name, built with ``kwargs`` (None: a hand-written ``forward``: "model",
    "first_token", "training_layers", "compiled", "compiled_ro" or "naive_cat"); ``captured``: `CapturedStep`'s
    keyword arguments (None: an eager step); ``per_layer``: draws its mixing layer per step from the suite's
    layers (CAT); ``attn``: the model's attention; ``first_token``: its passes run the last layer for the first
    token only; ``flops``: the FLOP count covers it (`benchmarks/steps/flops.py`)."""

    objective: Optional[str] = None
    kwargs: dict = field(default_factory=dict)
    forward: str = "model"
    captured: Optional[dict] = None
    per_layer: bool = False
    attn: str = "sdpa"
    first_token: bool = False
    flops: bool = True


# whether `captured_step` gives its step the batch as pinned CPU tensors on a GPU (module docstring); False:
# on the device, as the other steps get it
HOST_BATCHES = True
_CAT = dict(adv_steps=ADV_STEPS, alpha=ALPHA, beta=BETA, gamma=GAMMA, eta=ETA, adv_lr=ADV_LR)
_GS_TOKEN = dict(weight=1.0, representation=0)
_GS_POOLED = dict(weight=1.0, representation="pooled", mode="exact")

SPECS = {
    "plain": Method(),
    "plain_first_token": Method(forward="first_token", first_token=True),
    "plain_training_layers": Method(forward="training_layers", first_token=True),
    "naive_cat": Method(forward="naive_cat"),
    "cat": Method("cat", _CAT, per_layer=True, first_token=True),
    "cat_eager": Method("cat", dict(_CAT, cuda_graph=False), per_layer=True, first_token=True),
    "cat_full_last": Method("cat", dict(_CAT, prune_last_layer=False), per_layer=True),
    "cat_hf_layers": Method("cat", dict(_CAT, fast_resume=False), per_layer=True, first_token=True),
    "cat_hf_clean": Method("cat", dict(_CAT, training_layers=False), per_layer=True, first_token=True),
    "gs_exact": Method("gs", dict(_GS_TOKEN, mode="exact", fused_layers=False), attn="eager", flops=False),
    "gs_exact_fused": Method("gs", dict(_GS_TOKEN, mode="exact"), flops=False),
    "gs_first_order": Method("gs", dict(_GS_TOKEN, mode="first_order", difference="central"), first_token=True),
    "gs_first_order_fwd": Method("gs", dict(_GS_TOKEN, mode="first_order", difference="forward"), first_token=True),
    "gs_pooled": Method("gs", _GS_POOLED, first_token=True),
    "gs_pooled_hf_layers": Method("gs", dict(_GS_POOLED, training_layers=False), first_token=True),
    "poe": Method("poe", first_token=True),
    "reweight": Method("reweight", first_token=True),
    "learned_mixin": Method("learned-mixin", first_token=True),
    "conf_reg": Method("conf-reg", first_token=True),
    "clp": Method("clp"),
    "clp_all": Method("clp-all", attn="eager", flops=False),
    "plain_compiled": Method(forward="compiled"),
    "plain_compiled_ro": Method(forward="compiled_ro"),
    "plain_captured": Method("erm", captured={}),
    "plain_fast_captured": Method("erm", dict(fast=True), captured={}, first_token=True),
}


def _captured(name, warmup_steps=2, **kwargs):
    spec = SPECS[name]
    return replace(spec, kwargs={**spec.kwargs, **kwargs}, captured=dict(warmup_steps=warmup_steps))


SPECS["cat_captured"] = _captured("cat", warmup_steps=1)
SPECS["gs_first_order_captured"] = _captured("gs_first_order", low_memory=False)
SPECS["gs_first_order_fwd_captured"] = _captured("gs_first_order_fwd", low_memory=False)
for _name in ("gs_pooled", "gs_exact", "gs_exact_fused", "poe", "reweight", "learned_mixin", "conf_reg", "clp"):
    SPECS[_name + "_captured"] = _captured(_name)

METHODS = tuple(SPECS)
COMPILED_METHODS = tuple(m for m, s in SPECS.items() if s.forward.startswith("compiled"))
GS_LONG_METHODS = ("plain", "gs_exact", "gs_exact_fused", "gs_first_order", "gs_first_order_fwd")  # the T = 512 size


# ----------------------------------------------------------------------------- model, optimizer, batch


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


def with_bias(model, batch):
    """`batch` with a fixed bias [B, C] (log-probabilities) and teacher probabilities, as the CLI's batches of the
    bias-model objectives carry them."""
    gen = torch.Generator().manual_seed(7)
    shape = (batch["labels"].shape[0], model.config.num_labels)
    return dict(batch, bias=torch.log_softmax(2 * torch.randn(shape, generator=gen), -1).to(DEVICE),
                teacher_probs=torch.softmax(2 * torch.randn(shape, generator=gen), -1).to(DEVICE))


def metadata_batch(model, batch):
    """CLP's metadata batch: `batch`'s shape, another draw of ids and labels."""
    gen = torch.Generator().manual_seed(11)
    ids = batch["input_ids"]
    return dict(batch, input_ids=torch.randint(0, model.config.vocab_size, tuple(ids.shape), generator=gen).to(ids.device),
                labels=torch.randint(0, model.config.num_labels, tuple(batch["labels"].shape),
                                     generator=gen).to(ids.device))


# ----------------------------------------------------------------------------- the steps


def build_objective(name, model, batch, pairs, **kwargs):
    """(objective, its batch, its call's extra arguments): ``cat_fast.objectives.build(name, model, **kwargs)`` given
    what its class declares it needs (a metadata set, a bias model's predictions in the batch, pairs)."""
    from cat_fast import objectives

    cls = objectives.get(name).cls
    if getattr(cls, "needs_meta", False):
        kwargs["meta_batches"] = [metadata_batch(model, batch)]
    objective = objectives.build(name, model, **kwargs)
    if getattr(cls, "needs_bias", False):
        batch = with_bias(model, batch)
    return objective, batch, ((pairs,) if getattr(cls, "needs_pairs", False) else ())


def _finish(optimizer, loss):
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def objective_step(name, model, optimizer, batch, pairs, **kwargs):
    """The eager step of the registered objective `name`: its trainable tensors join `optimizer`, which it is
    given; ``step.layers`` collects the mixing layer of each call where the objective draws one (CAT)."""
    objective, batch, args = build_objective(name, model, batch, pairs, **kwargs)
    if objective.parameters():
        optimizer.add_param_group({"params": objective.parameters()})
    objective.set_optimizer(optimizer)

    def step():
        with autocast():
            loss, info = objective(batch, *args)
        if "layer" in info:
            step.layers.append(int(info["layer"]))  # a CPU tensor: no host sync
        _finish(optimizer, loss)
    step.layers, step.objective = [], objective
    return step


def captured_step(name, model, batch, pairs, capture, prime=False, **kwargs):
    """The registered objective `name` through `cat_fast.step.CapturedStep` (keyword arguments `capture`) under bf16
    autocast with its own AdamW (fused and capturable, a tensor lr, on a GPU) over the model's and the objective's
    parameters. ``prime=True``: ``step.prime()`` captures a graph per mixing layer (GPU only; at most 20 steps a
    layer), for `measure` to time apart before the warm-up."""
    from cat_fast.step import CapturedStep

    objective, batch, args = build_objective(name, model, batch, pairs, **kwargs)
    cuda = DEVICE == "cuda"
    params = list(model.parameters()) + list(objective.parameters())
    own = torch.optim.AdamW(params, lr=torch.tensor(2e-5, device=DEVICE) if cuda else 2e-5, fused=cuda,
                            capturable=cuda)
    objective.set_optimizer(own)
    captured = CapturedStep(objective, own, autocast=torch.bfloat16, **capture)
    if cuda and HOST_BATCHES and isinstance(batch, dict):
        batch = {k: v.cpu().pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def step():
        _, info = captured(batch, *args)
        if "layer" in info:
            step.layers.append(int(info["layer"]))
    step.layers, step.captured, step.objective = [], captured, objective
    if prime:
        layers = len(kwargs["layers"])

        def prime_graphs():
            for _ in range(20 * layers if cuda else 0):
                if captured.num_graphs == layers:
                    break
                step()
            step.layers.clear()
        step.prime = prime_graphs
    return step


def _plain_forward(kind, model):
    """The forward of a hand-written plain step: the model's own ("model"), compiled ("compiled", "compiled_ro":
    reduce-overhead), or `cat_fast.models.first_token_forward` ("first_token", "training_layers")."""
    if kind in ("first_token", "training_layers"):
        from cat_fast import models

        return functools.partial(models.first_token_forward, model, training_layers=kind == "training_layers")
    run = model if kind == "model" else torch.compile(model, mode="reduce-overhead" if kind == "compiled_ro" else None)

    def forward(batch):
        return run(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return forward


def plain_step(kind, model, optimizer, batch):
    """CE on the logits of `_plain_forward` (`kind`)."""
    forward = _plain_forward(kind, model)

    def step():
        with autocast():
            logits = forward(batch).logits
            loss = F.cross_entropy(logits.float(), batch["labels"])
        _finish(optimizer, loss)
    return step


def make_step(method, model, optimizer, batch, pairs, layers=None):
    """A closure that runs one training step of `method` (`SPECS`); `layers`: CAT's mixing layers (default: the
    suite's)."""
    spec = SPECS[method]
    if spec.objective is None:
        if spec.forward == "naive_cat":
            from benchmarks.steps.naive_cat import naive_cat_step

            return naive_cat_step(model, batch, lambda loss: _finish(optimizer, loss))
        return plain_step(spec.forward, model, optimizer, batch)
    kwargs = dict(spec.kwargs)
    if spec.per_layer:
        kwargs["layers"] = list(LAYERS if layers is None else layers)
    if spec.captured is None:
        return objective_step(spec.objective, model, optimizer, batch, pairs, **kwargs)
    # CAT: a graph per mixing layer; with packed rows (from `CAT.packed_min_rows` or with `PACKED = True`) one per layer
    # and row count, of which CapturedStep keeps packed graphs to half of max_graphs (then padded ones): room for two
    # row counts a layer
    capture = dict(spec.captured, max_graphs=4 * len(kwargs["layers"])) if spec.per_layer else spec.captured
    return captured_step(spec.objective, model, batch, pairs, capture, prime=spec.per_layer, **kwargs)


def build_step(method, size, layers=None):
    """(model, optimizer, step closure) of `method` at `size` ("BxT"): the model, batch and step the suite times;
    `layers`: CAT's mixing layers (default: the suite's)."""
    batch_size, tokens = H.dims(size)
    model = make_model(SPECS[method].attn)
    optimizer = make_optimizer(model)
    batch, pairs = make_batch(batch_size, tokens, model.config.vocab_size)
    return model, optimizer, make_step(method, model, optimizer, batch, pairs, layers)
