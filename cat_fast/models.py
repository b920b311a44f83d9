"""Everything cat_fast knows about a model's structure: the only module that looks inside one.

Objectives (`CAT`, `GradientSupervision`) ask this module three questions: *capture* the hidden state
``h_m`` of a batch during the model's own forward, *resume* the model from a replacement ``h̃`` at that
layer, and read the *pooled representation* that feeds the classification projection. No Hugging Face
modeling file is imported; the model is driven through its own ``forward`` with hooks.

Conventions and choices
-----------------------
Encoder layers.
    The layer list is the shallowest ``nn.ModuleList`` under ``model.base_model`` whose children all have
    the same class and own parameters (``bert.encoder.layer``, ``distilbert.transformer.layer``,
    ``albert.encoder.albert_layer_groups``, ...). Layers are identified by CALL ORDER during a forward, not
    by module: ALBERT calls its single shared layer group ``num_hidden_layers`` times and each call is one
    layer. Each forward checks that the list was called exactly ``config.num_hidden_layers`` times.
    Decoder-only models (any submodule with ``is_causal=True`` or ``config.is_decoder``), encoder-decoder
    models, models without such a list, heads other than ``*ForSequenceClassification`` /
    ``*ForQuestionAnswering`` and gradient checkpointing raise ``ValueError`` naming the class and why.

``h_m`` (1-indexed, ``0 <= m <= L``).
    ``h_m`` is the hidden state that layer ``m+1`` consumes (its first positional argument, or its
    ``hidden_states`` keyword) for ``m < L`` and the output of layer ``L`` for ``m = L``. For every supported
    architecture this equals ``hidden_states[m]`` of ``output_hidden_states=True`` (tested), including
    DeBERTa-v2, whose encoder applies a convolution after layer 1: ``hidden_states[1]`` is the conv output,
    i.e. the input of layer 2, which is what we mix. (Replacing layer 1's *module output* instead would run
    the conv again on the mixture and mix a different quantity than SPEC's ``hidden_states[m]``.)
    ``m = 0`` is the input of layer 1 (the embedding output; for ALBERT after its embedding projection).
    Caveat: on DeBERTa-v2 with a conv, ``m = 0`` mixes only the input of layer 1; the conv branch still
    reads the unmixed embeddings, exactly as a hook on layer 1's input would.

Capture and resume (no recomputation of lower layers).
    `capture` runs the model's own forward once with hooks that record each layer call's output (as the
    layer returned it: tensor or tuple), the embedding output and ``h_m``. `resume` calls the model's own
    forward again with the embedding module and layer calls ``1..m`` short-circuited (they return the cached
    outputs without computing) and with ``h̃`` passed to layer ``m+1`` in place of ``h_m``. Layers ``m+1..L``
    therefore receive exactly the arguments the model itself computes (extended attention mask in whatever
    form its attention implementation uses, DeBERTa's relative positions and rel-embeddings, ...), and the
    pooler/head run natively. Passing ``attention_mask=`` to `resume` (CMIX mask modes other than ``self``)
    replaces the 2-D mask given to the model, so it builds its own extended mask from it. The embedding
    module is skipped when the base model has an ``embeddings`` submodule (all supported architectures);
    otherwise it runs again (cheap) and its output is ignored. Short-circuiting works by setting an
    instance-level ``forward`` on the layer modules for the duration of the call (restored afterwards), which
    is why gradient checkpointing (which re-runs ``forward`` during backward) is refused.

Dropout (train mode).
    `resume(..., same_dropout=True)` (default) restores the random-number-generator state that the captured
    forward had when layer ``m+1`` started, so layers ``m+1..L`` and the head draw the same dropout masks as
    in the clean forward; the caller's RNG state is restored afterwards. Consequence: with ``h̃ = h_m`` the
    resumed logits equal the clean logits bit-for-bit, in train mode too, so a CAT counterfactual differs
    from its factual only by the mixing. The same holds for `head_logits` (re-running only the head).
    Saving/restoring RNG state is host-side bookkeeping (no device synchronisation).

First-token last layer (``resume(..., first_token=True)``).
    When the head reads only row 0 of the last layer's output (sequence classifiers with a [CLS] pooler or
    head), the last layer is run for that row only: keys and values of every token, everything else for row 0
    (`cat_fast.first_token_layer`; Bert and DistilBERT layouts). Rows 1.. of the returned last hidden state are
    then the last layer's INPUT rows, not its output. `first_token_ok` decides, once per model, whether this is exact:
    the layer must have the supported layout and, on a real batch in eval mode without autocast, the resumed
    logits must not change when rows 1.. are NaN and must equal the full layer's (rtol 1e-4 for float32
    weights, 2e-2 for 16-bit). `first_token_ready` takes that decision before a step (on a no-grad eval capture
    of its batch), so that the clean forward can be pruned too: ``capture(..., first_token=True)`` and
    `first_token_forward` (a plain forward) run the same first-token layer; calls that ask for hidden states or
    attentions, and ``m = L``, run it whole. Dropout: a resume with ``first_token=True`` from a pruned capture
    draws the capture's masks in every layer, the last included; from a full capture, the last layer's row-0
    masks are fresh draws (one query row's attention dropout cannot replay the full layer's draws).

Pooled representation.
    The input of the classification projection module: ``model.classifier`` if present, else ``model.score``,
    else the last ``nn.Linear`` with ``out_features == num_labels`` (``qa_outputs`` for QA). When that module
    takes the whole sequence (RoBERTa, ELECTRA classification heads) the representation is its first-token
    row; `head_logits` then re-runs the head on the sequence with row 0 replaced, so it is exact for any head
    that reads only the first token and a faithful "first-token" function otherwise.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from . import first_token_layer, resumed_layer, training_layer

__all__ = [
    "ModelStructure",
    "Capture",
    "structure",
    "num_layers",
    "capture",
    "resume",
    "first_token_ok",
    "first_token_ready",
    "first_token_forward",
    "head_logits",
    "grad_wrt_pooled",
    "logits_of",
    "model_inputs",
    "sync_free_inputs",
]

# Batch keys that are targets or cat_fast metadata, never passed to the model's forward.
TARGET_KEYS = ("labels", "start_positions", "end_positions", "pairs", "context_mask")


@dataclass(frozen=True)
class ModelStructure:
    """What cat_fast needs to know about a model; computed once per model by `structure`."""

    model_class: str
    layer_list_name: str
    layer_modules: tuple  # unique modules of the layer list, in list order
    num_layers: int  # number of layer CALLS per forward (L)
    embeddings: nn.Module | None
    head: nn.Module
    head_name: str
    task: str  # "sequence_classification" | "question_answering"
    checkpoint_flags: tuple = ()  # modules with a `gradient_checkpointing` attribute (Hugging Face's switch)


@dataclass
class Capture:
    """Result of `capture`: the model outputs of the clean forward and what `resume` needs."""

    layer: int
    hidden: torch.Tensor  # h_m, part of the clean forward's graph
    outputs: object  # the model's own output (ModelOutput)
    inputs: dict  # keyword arguments the model was called with
    training: bool
    layer_outputs: list = field(default_factory=list)  # outputs of layer calls 1..m, as returned
    hidden_loc: tuple | None = None  # where h_m sits in layer m+1's arguments: ("arg", i) / ("kw", name)
    embedding_output: object = None
    rng_state: tuple | None = None  # RNG state when layer m+1 started (or after layer L for m = L)
    head_input: torch.Tensor | None = None  # input of the classification projection (pooled=True)
    head_rng_state: tuple | None = None
    pooled: torch.Tensor | None = None  # [B, D] pooled representation (pooled=True)
    rng_marker: object = None  # called by `resume` where it would restore rng_state (cat_fast.cal_graph)
    last_output: object = None  # layer L's output as returned (its format, for `resume(..., first_token=True)`)
    padding_mask: torch.Tensor | None = None  # the batch's 2-D attention mask ([B, T]; `inputs` may hold a 4-D one)


_STRUCTURES: "weakref.WeakKeyDictionary[nn.Module, ModelStructure]" = weakref.WeakKeyDictionary()


def _fail(model, why):
    raise ValueError(f"cat_fast does not support {type(model).__name__}: {why}")


def _find_layer_list(model, base):
    candidates = []
    for name, mod in base.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        kinds = {type(child) for child in mod}
        if len(kinds) != 1 or not any(True for _ in mod[0].parameters()):
            continue
        candidates.append((name.count("."), name, mod))
    if not candidates:
        _fail(model, "no nn.ModuleList of encoder layers found under its base model")
    depth = min(c[0] for c in candidates)
    shallowest = [c for c in candidates if c[0] == depth]
    if len(shallowest) > 1:
        names = ", ".join(c[1] for c in shallowest)
        _fail(model, f"several candidate layer lists ({names}); cannot tell which is the encoder")
    return shallowest[0][1], shallowest[0][2]


def _find_head(model, task):
    if task == "question_answering":
        names = ("qa_outputs",)
        width = 2
    else:
        names = ("classifier", "score")
        width = model.config.num_labels
    for name in names:
        mod = getattr(model, name, None)
        if isinstance(mod, nn.Module):
            return name, mod
    last = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and mod.out_features == width:
            last = (name, mod)
    if last is None:
        _fail(model, f"no classification projection (nn.Linear with out_features={width}) found")
    return last


def structure(model) -> ModelStructure:
    """Inspect `model` once (cached): its encoder layer list, embedding module and classification head."""
    found = _STRUCTURES.get(model)
    if found is not None:
        return found
    cls = type(model).__name__
    config = getattr(model, "config", None)
    if config is None:
        _fail(model, "not a Hugging Face PreTrainedModel (no .config)")
    if getattr(config, "is_encoder_decoder", False):
        _fail(model, "encoder-decoder models are not supported (CAT mixes an encoder layer)")
    causal = [n for n, m in model.named_modules() if getattr(m, "is_causal", False) is True]
    if getattr(config, "is_decoder", False) or causal:
        where = f" (causal attention in {causal[0]})" if causal else ""
        _fail(model, f"decoder-only / causal models are not supported{where}; use a bidirectional encoder")
    if cls.endswith("ForQuestionAnswering"):
        task = "question_answering"
    elif cls.endswith("ForSequenceClassification"):
        task = "sequence_classification"
    else:
        _fail(model, "only *ForSequenceClassification and *ForQuestionAnswering heads are supported")
    base = getattr(model, "base_model", model)
    list_name, layer_list = _find_layer_list(model, base)
    unique = []
    for child in layer_list:
        if all(child is not u for u in unique):
            unique.append(child)
    n_layers = getattr(config, "num_hidden_layers", None) or len(layer_list)
    embeddings = getattr(base, "embeddings", None)
    if not isinstance(embeddings, nn.Module):
        embeddings = None
    head_name, head = _find_head(model, task)
    prefix = getattr(model, "base_model_prefix", "")
    found = ModelStructure(
        model_class=cls,
        layer_list_name=f"{prefix}.{list_name}" if prefix and base is not model else list_name,
        layer_modules=tuple(unique),
        num_layers=int(n_layers),
        embeddings=embeddings,
        head=head,
        head_name=head_name,
        task=task,
        checkpoint_flags=tuple(m for m in model.modules() if hasattr(m, "gradient_checkpointing")),
    )
    _STRUCTURES[model] = found
    return found


def num_layers(model) -> int:
    """Number of encoder layer calls L per forward (ALBERT: num_hidden_layers, though one module)."""
    return structure(model).num_layers


def model_inputs(batch) -> dict:
    """The batch without targets and cat_fast metadata: what the model's forward takes."""
    return {k: v for k, v in batch.items() if k not in TARGET_KEYS}


_MASK_4D: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def _padding_mask_4d(mask):
    """The mask Hugging Face's SDPA path builds from a 2-D padding mask when the batch has padding: bool
    [B, 1, T, T], True where a query may attend a key."""
    T = mask.shape[-1]
    return mask.bool()[:, None, None, :] & torch.ones(T, 1, dtype=torch.bool, device=mask.device)


def _close(got, want, rtol, atol):
    """allclose of logits (a tensor, or a tuple for QA) in float32, `atol` scaled by 1 + max |want|."""
    pairs = list(zip(got, want)) if isinstance(want, tuple) else [(got, want)]
    return all(torch.allclose(g.float(), w.float(), rtol=rtol, atol=atol * (1.0 + float(w.abs().max())))
               for g, w in pairs)


def _mask_4d_ok(model, inputs) -> bool:
    """Whether `model` computes the same with `_padding_mask_4d(mask)` as with the 2-D mask; decided once per model
    (two eval-mode, no-grad forwards of this batch with one padded position added, one host synchronisation)."""
    known = _MASK_4D.get(model)
    if known is None:
        probe = inputs["attention_mask"].clone()
        probe[0, -1] = 0  # a padded position, so that the model's own forward builds and uses its mask
        try:
            with _eval_no_grad(model, probe.device.type):
                want = logits_of(model(**dict(inputs, attention_mask=probe)))
                got = logits_of(model(**dict(inputs, attention_mask=_padding_mask_4d(probe))))
            known = _close(got, want, rtol=1e-4, atol=1e-5)
        except Exception:  # noqa: BLE001 - a model that cannot take the 4-D mask keeps its own
            known = False
        _MASK_4D[model] = known
    return known


def sync_free_inputs(model, inputs: dict) -> dict:
    """`inputs` with a 2-D attention mask replaced by the 4-D mask the model's SDPA attention builds from it, when
    the model computes the same with it (checked once per model: `_mask_4d_ok`).

    Hugging Face's SDPA mask code asks whether the 2-D mask has any padding (``padding_mask.all()``, to drop the
    mask and use the unmasked kernel when there is none): a host synchronisation in every forward of a batch
    that carries an attention mask. Given the 4-D mask, the model uses it as is: no synchronisation, so the host
    can queue the step ahead of the GPU. The values are those of the model's own mask (the same tensor when the
    batch has padding); a batch without padding then runs the masked kernel instead of the unmasked one (the same
    values up to rounding). Models with eager attention, or that use the mask elsewhere (DeBERTa-v2's
    embeddings), keep their 2-D mask."""
    mask = inputs.get("attention_mask")
    if (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] < 2 or mask.is_floating_point()
            or getattr(getattr(model, "config", None), "_attn_implementation", None) != "sdpa"
            or not _mask_4d_ok(model, inputs)):
        return inputs
    return dict(inputs, attention_mask=_padding_mask_4d(mask))


def logits_of(outputs):
    """`logits` of a classification output; `(start_logits, end_logits)` of a QA output."""
    if hasattr(outputs, "start_logits"):
        return outputs.start_logits, outputs.end_logits
    if hasattr(outputs, "logits"):
        return outputs.logits
    return outputs[0]


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _replace_first(out, h):
    if isinstance(out, tuple):
        return (h,) + tuple(out[1:])
    if isinstance(out, list):
        return [h] + list(out[1:])
    return h


def _hidden_arg(args, kwargs):
    if args:
        return args[0], ("arg", 0)
    for name in ("hidden_states", "hidden_state", "x"):
        if isinstance(kwargs.get(name), torch.Tensor):
            return kwargs[name], ("kw", name)
    raise ValueError("cat_fast: cannot find the hidden-state argument of an encoder layer call")


def _rng_get(device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _rng_set(device, state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _patch_forward(mod, fwd):
    """Set an instance-level ``forward`` on `mod`; returns what `_unpatch_forward` needs to undo it."""
    saved = (mod, "forward" in mod.__dict__, mod.__dict__.get("forward"))
    mod.forward = fwd
    return saved


def _unpatch_forward(saved):
    mod, had, old = saved
    if had:
        mod.forward = old
    else:
        del mod.forward


def _check_trainable_forward(model, st):
    # Hugging Face's is_activation_checkpointing walks every module on each call (~1 ms of host time per
    # step for BERT-base); the modules that carry the flag are found once, in `structure`.
    if any(getattr(m, "gradient_checkpointing", False) is True for m in st.checkpoint_flags):
        _fail(model, "gradient checkpointing re-runs layer forwards during backward; disable it for CAT/GS")


def capture(model, batch, layer: int | None, *, pooled: bool = False, rng: bool = True,
            first_token: bool = False, on_hidden=None, training_layers: bool = False) -> Capture:
    """Run the model's own forward once on `batch`, recording ``h_layer`` and what `resume` needs.

    `batch` may contain targets (`labels`, ...); they are not passed to the model. With ``pooled=True`` also
    record the pooled representation (the input of the classification projection). ``layer=None`` (with
    ``pooled=True``) records only the pooled representation: no hook on the encoder layers, less host work
    (no `resume` from such a capture). ``rng=False``: no RNG states recorded (no same-dropout re-runs).
    ``first_token=True``: the last layer runs for the first token only when `first_token_ready` has accepted the
    model and ``layer < L`` (then rows 1.. of its output are its input rows; the logits are the same).
    ``on_hidden(cap)``: called inside the forward as soon as ``h_layer`` exists (``layer < L``: when layer
    ``layer + 1`` is about to run, with `cap` filled up to there: ``hidden``, ``hidden_loc``, ``rng_state``,
    ``layer_outputs``, ``inputs``), so work that needs only ``h_layer`` can be queued on the GPU before the rest of
    the forward. It must leave the RNG state as it found it. ``training_layers=True``: the encoder layers run
    `training_layer` where it supports them (see there: the same values, dropout draws and gradients, one autograd
    node per layer; no double backward through them).
    """
    st = structure(model)
    _check_trainable_forward(model, st)
    L = st.num_layers
    if layer is None and not pooled:
        raise ValueError("capture(layer=None) records nothing unless pooled=True")
    if layer is not None and not 0 <= layer <= L:
        raise ValueError(f"layer must be in [0, {L}] for {st.model_class}, got {layer}")
    given = model_inputs(batch)
    inputs = sync_free_inputs(model, given)
    cap = Capture(layer=layer, hidden=None, outputs=None, inputs=inputs, training=model.training,
                  padding_mask=given.get("attention_mask"))
    calls = {"started": 0, "done": 0}
    keep_rng = model.training and rng

    def pre(mod, args, kwargs):
        k = calls["started"]
        calls["started"] += 1
        if k == layer:
            cap.hidden, cap.hidden_loc = _hidden_arg(args, kwargs)
            if keep_rng:
                cap.rng_state = _rng_get(cap.hidden.device)
            if on_hidden is not None:
                on_hidden(cap)

    def post(mod, args, kwargs, output):
        k = calls["done"]
        calls["done"] += 1
        if k < layer:
            cap.layer_outputs.append(output)
        if k == L - 1:
            cap.last_output = output
        if k == L - 1 and layer == L:
            cap.hidden = _first(output)
            if keep_rng:
                cap.rng_state = _rng_get(cap.hidden.device)

    def emb_post(mod, args, output):
        cap.embedding_output = output

    def head_pre(mod, args, kwargs):
        x, _ = _hidden_arg(args, kwargs)
        cap.head_input = x
        cap.pooled = x[:, 0] if x.dim() == 3 else x
        if keep_rng:
            cap.head_rng_state = _rng_get(x.device)

    handles = []
    try:
        if layer is not None:
            for mod in st.layer_modules:
                handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(mod.register_forward_hook(post, with_kwargs=True))
            if st.embeddings is not None:
                handles.append(st.embeddings.register_forward_hook(emb_post))
        if pooled:
            handles.append(st.head.register_forward_pre_hook(head_pre, with_kwargs=True))
        prune = first_token and (layer is None or layer < L)
        with _training_layers(model, st, inputs, training_layers), _last_layer_first_token(model, st, inputs, prune):
            cap.outputs = model(**inputs)
    finally:
        for h in handles:
            h.remove()
    if layer is not None and calls["started"] != L:
        _fail(model, f"its layer list '{st.layer_list_name}' was called {calls['started']} times in one forward, "
                     f"expected {L} (config.num_hidden_layers)")
    if pooled and cap.head_input is None:
        _fail(model, f"its classification module '{st.head_name}' was not called in the forward")
    return cap


def resume(model, cap: Capture, h_tilde: torch.Tensor, attention_mask=None, *, same_dropout: bool = True,
           first_token: bool = False, first_token_fill: float | None = None, input_grad_only: bool = False,
           training_layers: bool = False):
    """Run layers ``m+1..L`` and the model's own head on `h_tilde` in place of ``h_m``; return the model output.

    The lower layers are not recomputed (see the module docstring). `attention_mask` (2-D, optional)
    replaces the batch's mask for the resumed layers (CMIX mask modes). Differentiable w.r.t. `h_tilde` and
    the parameters of layers ``m+1..L`` and the head. ``first_token=True``: the last layer computes row 0
    only (module docstring; check `first_token_ok` first); `first_token_fill` sets its other rows (the probe).
    ``input_grad_only=True`` promises that no parameter gradient is taken through this pass (CAT's CAL steps and
    its detached final pass): layers ``m+1..L`` with the Bert layout then run `resumed_layer` (same values and
    dropout draws; the input gradient summed in fp32 under autocast). ``training_layers=True`` (without
    ``input_grad_only``): layers ``m+1..L`` run `training_layer` where it supports them (the same values, dropout
    draws and gradients, parameters included; no double backward through them).
    """
    st = structure(model)
    _check_trainable_forward(model, st)
    if tuple(h_tilde.shape) != tuple(cap.hidden.shape):
        raise ValueError(f"h_tilde must have the shape of h_m {tuple(cap.hidden.shape)}, got {tuple(h_tilde.shape)}")
    m, L = cap.layer, st.num_layers
    restore_rng = same_dropout and cap.rng_state is not None and model.training
    device = h_tilde.device
    saved_rng = _rng_get(device) if restore_rng else None
    calls = {"n": 0}
    patched = []

    def layer_forward(mod):
        orig = mod.forward

        def forward(*args, **kwargs):
            k = calls["n"]
            calls["n"] += 1
            if k < m:
                out = cap.layer_outputs[k]
                if k == L - 1:  # m == L: the last layer's output is replaced
                    out = _replace_first(out, h_tilde)
                    if restore_rng:
                        _rng_set(device, cap.rng_state)
                    if cap.rng_marker is not None:
                        cap.rng_marker()
                return out
            if k == m:
                kind, where = cap.hidden_loc
                if kind == "arg":
                    args = (h_tilde,) + tuple(args[1:])
                else:
                    kwargs = dict(kwargs)
                    kwargs[where] = h_tilde
                if restore_rng:
                    _rng_set(device, cap.rng_state)
                if cap.rng_marker is not None:
                    cap.rng_marker()
            if k == L - 1 and first_token:
                out = first_token_layer.forward(mod, args, kwargs, first_token_fill)
                if out is not None:
                    return _replace_first(cap.last_output, out)
            elif input_grad_only and cap.last_output is not None:
                out = resumed_layer.forward(mod, args, kwargs)
                if out is not None:
                    return _replace_first(cap.last_output, out)
            elif training_layers and cap.last_output is not None:
                out = training_layer.forward(mod, args, kwargs)
                if out is not None:
                    return _replace_first(cap.last_output, out)
            return orig(*args, **kwargs)

        return forward

    inputs = dict(cap.inputs)
    if attention_mask is not None:
        inputs = sync_free_inputs(model, dict(inputs, attention_mask=attention_mask))
    try:
        for mod in st.layer_modules:
            patched.append(_patch_forward(mod, layer_forward(mod)))
        if st.embeddings is not None and cap.embedding_output is not None:
            cached = cap.embedding_output
            patched.append(_patch_forward(st.embeddings, lambda *a, **k: cached))
        out = model(**inputs)
    finally:
        for saved in reversed(patched):
            _unpatch_forward(saved)
        if restore_rng:
            _rng_set(device, saved_rng)
    if calls["n"] != L:
        _fail(model, f"its layer list '{st.layer_list_name}' was called {calls['n']} times when resuming, "
                     f"expected {L}")
    return out


_FIRST_TOKEN: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()
# The format of the last layer's output (None: a tensor; n: a tuple of n whose items after the first are None),
# recorded by the check so that a forward can return its first-token row in that format.
_LAST_FORMAT: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()


def _output_format(out):
    if isinstance(out, torch.Tensor):
        return None
    if isinstance(out, (tuple, list)) and out and all(v is None for v in out[1:]):
        return (type(out), len(out))
    return False


def _formatted(fmt, row):
    if fmt is None:
        return row
    kind, n = fmt
    return kind((row,) + (None,) * (n - 1))


# The format of a layer's output for `_training_layers` (as `_LAST_FORMAT`; False: not a format it can give),
# recorded from the model's own layer on the first training forward of each model.
_LAYER_FORMAT: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()


def _wants_all_outputs(model, inputs):
    config = model.config
    return any(bool(getattr(config, k, False) if inputs.get(k) is None else inputs[k])
               for k in ("output_hidden_states", "output_attentions"))


@contextmanager
def _training_layers(model, st, inputs, enabled):
    """While active, the encoder layers run `training_layer` (one autograd node per layer: the same values, dropout
    draws and gradients with less host work) where it supports the layer and the call; the rest run themselves
    (a first-token last layer, patched inside this, falls back to this). Off when the call asks for hidden states
    or attentions."""
    if not enabled or _wants_all_outputs(model, inputs) or _LAYER_FORMAT.get(model) is False:
        yield
        return
    layers = st.layer_modules
    if not any(training_layer.supported(mod) for mod in layers):
        yield
        return
    fmt = _LAYER_FORMAT.get(model, "unknown")

    def layer_forward(mod, orig):
        def forward(*args, **kwargs):
            if fmt == "unknown":
                out = orig(*args, **kwargs)
                _LAYER_FORMAT[model] = _output_format(out)
                return out
            y = training_layer.forward(mod, args, kwargs)
            return orig(*args, **kwargs) if y is None else _formatted(fmt, y)

        return forward

    patched = [_patch_forward(mod, layer_forward(mod, mod.forward)) for mod in layers]
    try:
        yield
    finally:
        for saved in reversed(patched):
            _unpatch_forward(saved)


@contextmanager
def _last_layer_first_token(model, st, inputs, enabled):
    """While active, the last layer's forward returns its first-token row (`first_token_layer.forward`) when
    `first_token_ready` accepted the model and the call does not ask for hidden states or attentions."""
    if not enabled or _wants_all_outputs(model, inputs) or _FIRST_TOKEN.get(model) is not True:
        yield
        return
    mod = st.layer_modules[-1]
    orig, fmt = mod.forward, _LAST_FORMAT.get(model)

    def forward(*args, **kwargs):
        row = first_token_layer.forward(mod, args, kwargs)
        return orig(*args, **kwargs) if row is None else _formatted(fmt, row)

    saved = _patch_forward(mod, forward)
    try:
        yield
    finally:
        _unpatch_forward(saved)


@contextmanager
def _eval_no_grad(model, device_type):
    """Eval mode, no autograd, no autocast; the modules' training flags restored on exit."""
    modes = [(mod, mod.training) for mod in model.modules()]
    try:
        model.eval()
        with torch.no_grad(), torch.autocast(device_type, enabled=False):
            yield
    finally:
        for mod, mode in modes:
            mod.training = mode


def _first_token_known(model, st):
    """The cached decision for `model`, False (cached) when its layout is not supported, else None."""
    known = _FIRST_TOKEN.get(model)
    if known is None and not (st.task == "sequence_classification" and len(st.layer_modules) == st.num_layers
                              and first_token_layer.supported(st.layer_modules[-1])):
        known = _FIRST_TOKEN[model] = False
    return known


def first_token_ok(model, cap: Capture) -> bool:
    """Whether ``resume(..., first_token=True)`` is exact for `model` (module docstring); decided once per model
    on the first capture with ``m < L`` (two no-grad resumes of that batch and one host synchronisation)."""
    st = structure(model)
    known = _first_token_known(model, st)
    if known is not None:
        return known
    if cap.layer >= st.num_layers or cap.last_output is None:
        return False  # no layer to run after h_m here: decide on a later capture
    fmt = _output_format(cap.last_output)
    h = cap.hidden.detach()
    with _eval_no_grad(model, h.device.type):
        full = logits_of(resume(model, cap, h))
        pruned = logits_of(resume(model, cap, h, first_token=True, first_token_fill=float("nan")))
    half = next(model.parameters()).dtype in (torch.float16, torch.bfloat16)
    tol = 2e-2 if half else 1e-4
    ok = fmt is not False and bool(torch.isfinite(pruned).all()) and _close(pruned, full, rtol=tol, atol=tol)
    if ok:
        _LAST_FORMAT[model] = fmt
    _FIRST_TOKEN[model] = ok
    return ok


def first_token_ready(model, batch) -> bool:
    """`first_token_ok` for `model`, decided if needed on a capture of `batch` below the last layer (eval mode,
    no autograd: one extra forward, once per model, drawing no random numbers)."""
    st = structure(model)
    known = _first_token_known(model, st)
    if known is not None:
        return known
    device = next(model.parameters()).device
    with _eval_no_grad(model, device.type):
        cap = capture(model, batch, st.num_layers - 1, rng=False)
    return first_token_ok(model, cap)


def first_token_forward(model, batch, *, training_layers: bool = False):
    """The model's own forward on `batch` (targets left out) with its last layer run for the first token only
    when `first_token_ready` accepts the model: the same logits and gradients as ``model(**inputs)`` with about
    5/6 of the last layer's matmuls skipped. For plain fine-tuning loops; the other models run unchanged.
    ``training_layers=True``: the other encoder layers run `training_layer` where it supports them (the same
    values and gradients with less host work; no double backward through them)."""
    st = structure(model)
    inputs = sync_free_inputs(model, model_inputs(batch))
    ready = first_token_ready(model, batch)
    with _training_layers(model, st, inputs, training_layers), _last_layer_first_token(model, st, inputs, ready):
        return model(**inputs)


def head_logits(model, cap: Capture, x: torch.Tensor, *, same_dropout: bool = True):
    """Logits of the classification projection re-run on a pooled representation `x` [B, D].

    Needs ``capture(..., pooled=True)``. Differentiable w.r.t. `x` and the head's parameters. With
    ``same_dropout`` the head draws the dropout masks of the captured forward.
    """
    st = structure(model)
    if cap.head_input is None:
        raise ValueError("head_logits needs capture(..., pooled=True)")
    inp = cap.head_input
    if inp.dim() == 3:
        inp = torch.cat([x.unsqueeze(1), inp[:, 1:]], dim=1)
    else:
        inp = x
    restore = same_dropout and cap.head_rng_state is not None and model.training
    saved = _rng_get(x.device) if restore else None
    try:
        if restore:
            _rng_set(x.device, cap.head_rng_state)
        return st.head(inp)
    finally:
        if restore:
            _rng_set(x.device, saved)


def grad_wrt_pooled(score: torch.Tensor, cap: Capture, *, create_graph: bool) -> torch.Tensor:
    """``∇_x score`` for the captured pooled representation x ([B, D]); `score` a scalar of the clean forward."""
    if cap.head_input is None:
        raise ValueError("grad_wrt_pooled needs capture(..., pooled=True)")
    (g,) = torch.autograd.grad(score, cap.head_input, create_graph=create_graph, retain_graph=True)
    return g[:, 0] if g.dim() == 3 else g
