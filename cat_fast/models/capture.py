"""Capture and resume: the hidden state ``h_m`` of a batch from the model's own forward, and the model resumed from
a replacement ``h̃`` at that layer without recomputing the layers below (docs/METHODS.md §1.1, §1.6).

`capture` runs the model's forward once with hooks that record each layer call's output, the embedding output and
``h_m`` (with the RNG state when layer m+1 starts). `resume` calls the forward again with the embeddings and layer
calls 1..m short-circuited (they return the recorded outputs) and ``h̃`` passed to layer m+1, so layers m+1..L get
exactly the arguments the model computes, and (``same_dropout``) draw the clean forward's dropout masks. Layers
are identified by call order (ALBERT calls one shared layer L times). ``h_m`` equals ``hidden_states[m]``. A
compiled model runs its own forward in both (`structure.uncompiled`): the values of the uncompiled model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import layers
from . import fast_layers
from .inputs import model_inputs, sync_free_inputs
from .patching import first_of, hidden_argument, patch_forward, replace_first, unpatch_forward
from .rng import get_state as get_rng_state
from .rng import graph_offset as _graph_offset
from .rng import set_state as set_rng_state
from .structure import check_trainable_forward, orig_module, structure, uncompiled, unsupported

__all__ = ["Capture", "capture", "resume", "head_logits", "grad_wrt_pooled"]


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
    rng_offset: int | None = None  # inside a CUDA-graph capture, where no state is read: the device generator's
    # offset within the graph there (`ops.fused.rng_offset`), handed to `rng_marker`
    head_input: torch.Tensor | None = None  # input of the classification projection (pooled=True)
    head_rng_state: tuple | None = None
    head_rng_offset: int | None = None  # the same at the head, inside a capture
    head_autocast: tuple | None = None  # (enabled, dtype) of autocast where the model's forward called its head
    pooled: torch.Tensor | None = None  # [B, D] pooled representation (pooled=True)
    rng_marker: object = None  # called by `resume` / `head_logits` where they restore the RNG state, given the
    # offset recorded there inside a capture (`rng_offset`, `head_rng_offset`; None elsewhere): CALGraphs,
    # PassGenerators
    last_output: object = None  # layer L's output as returned (its format, for `resume(..., first_token=True)`)
    padding_mask: torch.Tensor | None = None  # the batch's 2-D attention mask ([B, T]; `inputs` may hold a 4-D one)


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
    `layers.training` where it supports them (see there: the same values, dropout draws and gradients, one autograd
    node per layer; no double backward through them); where they pack the rows (`layers.training.PACKED`) the rows
    stay packed from layer to layer (`layers.packing.carry`) around this function's own hooks, ``h_layer`` is their
    unpacked form, and the recorded outputs of the layers below may be packed rows (what `resume` returns unread).
    """
    model = orig_module(model)
    st = structure(model)
    check_trainable_forward(model, st)
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
    # inside a CUDA-graph capture no state is read: the offset within the graph is, where the state would be
    graph_rng = model.training and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    def pre(mod, args, kwargs):
        k = calls["started"]
        calls["started"] += 1
        if k == layer:
            cap.hidden, cap.hidden_loc = hidden_argument(args, kwargs)
            found = layers.packing.carried(cap.hidden)
            if found is not None:  # the previous layer's packed rows: h_m is their unpacked form, which layer m+1 gets
                cap.hidden = layers.packing.unpack(cap.hidden, *found)
                args, kwargs = _with_hidden(args, kwargs, cap.hidden_loc, cap.hidden)
            if keep_rng:
                cap.rng_state = get_rng_state(cap.hidden.device)
            elif graph_rng:
                cap.rng_offset = _graph_offset(cap.hidden.device)
            if on_hidden is not None:
                on_hidden(cap)
            if found is not None:
                return args, kwargs
        return None

    def post(mod, args, kwargs, output):
        k = calls["done"]
        calls["done"] += 1
        if k < layer:
            cap.layer_outputs.append(output)
        if k == L - 1:
            cap.last_output = output
        if k == L - 1 and layer == L:
            cap.hidden = first_of(output)
            if keep_rng:
                cap.rng_state = get_rng_state(cap.hidden.device)
            elif graph_rng:
                cap.rng_offset = _graph_offset(cap.hidden.device)

    def emb_post(mod, args, output):
        cap.embedding_output = output

    def head_pre(mod, args, kwargs):
        x, _ = hidden_argument(args, kwargs)
        cap.head_input = x
        cap.pooled = x[:, 0] if x.dim() == 3 else x
        # a wrapper may autocast inside the model's forward only (accelerate's mixed precision): re-runs of the
        # head take this state, not the caller's
        cap.head_autocast = (torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type))
        if keep_rng:
            cap.head_rng_state = get_rng_state(x.device)
        elif graph_rng:
            cap.head_rng_offset = _graph_offset(x.device)

    handles = []
    try:
        handles += _capture_hooks(st, layer is not None, pooled, pre, post, emb_post, head_pre)
        prune = first_token and (layer is None or layer < L)
        # the layers may hand packed rows on (`layers.packing.carry`): the hooks here record what `resume` returns
        # unread and unpack h_m
        with fast_layers.training_layers(model, st, inputs, training_layers, carry=True,
                                         own_hooks=[h.id for h in handles]), \
                fast_layers.last_layer_first_token(model, st, inputs, prune), uncompiled(model) as module:
            cap.outputs = module(**inputs)
    finally:
        for h in handles:
            h.remove()
    _check_captured(model, st, cap, layer, calls["started"], pooled)
    return cap


def _capture_hooks(st, layers: bool, pooled: bool, pre, post, emb_post, head_pre) -> list:
    """`capture`'s hooks: on every encoder layer and the embeddings (``layers``), on the head (``pooled``)."""
    handles = []
    if layers:
        for mod in st.layer_modules:
            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(mod.register_forward_hook(post, with_kwargs=True))
        if st.embeddings is not None:
            handles.append(st.embeddings.register_forward_hook(emb_post))
    if pooled:
        handles.append(st.head.register_forward_pre_hook(head_pre, with_kwargs=True))
    return handles


def _check_captured(model, st, cap: Capture, layer, started: int, pooled: bool) -> None:
    """`unsupported` where the forward `capture` watched did not go as the model's structure says."""
    L = st.num_layers
    if (layer is not None and cap.hidden is not None and cap.padding_mask is not None
            and cap.hidden.shape[1] != cap.padding_mask.shape[-1]):
        unsupported(model, f"it pads the sequence inside its forward ({cap.padding_mask.shape[-1]} tokens in the batch, "
                           f"{cap.hidden.shape[1]} at layer {layer}; Longformer-style models pad to a multiple of "
                           "config.attention_window): pad the batches to that multiple yourself (tokenizer(..., "
                           "pad_to_multiple_of=N)) so that it has nothing to pad")
    if layer is not None and started != L:
        unsupported(model, f"its layer list '{st.layer_list_name}' was called {started} times in one forward, "
                     f"expected {L} (config.num_hidden_layers)")
    if pooled and cap.head_input is None:
        unsupported(model, f"its classification module '{st.head_name}' was not called in the forward")


def resume(model, cap: Capture, h_tilde: torch.Tensor, attention_mask=None, *, same_dropout: bool = True,
           first_token: bool = False, first_token_fill: float | None = None, first_token_row_only: bool = False,
           input_grad_only: bool = False, training_layers: bool = False, repeat: int = 1):
    """Run layers ``m+1..L`` and the model's own head on `h_tilde` in place of ``h_m``; return the model output.

    The lower layers are not recomputed (see the module docstring). `attention_mask` (2-D, optional)
    replaces the batch's mask for the resumed layers (CMIX mask modes). Differentiable w.r.t. `h_tilde` and
    the parameters of layers ``m+1..L`` and the head. ``first_token=True``: the last layer computes row 0
    only (module docstring; check `first_token_ok` first); `first_token_fill` sets its other rows (the probe);
    ``first_token_row_only=True`` hands the head a last hidden state of one row, ``[B, 1, D]`` (passes whose output
    only the head reads: CAT's counterfactual passes, GS's perturbed passes).
    ``input_grad_only=True`` promises that no parameter gradient is taken through this pass (CAT's CAL steps and
    its detached final pass): layers ``m+1..L`` with the Bert layout then run `layers.resumed` (same values and
    dropout draws; the input gradient summed in fp32 under autocast), or `layers.training` where it packs the rows
    (`layers.training.PACKED`), as the clean forward's training layers did. ``training_layers=True`` (without
    ``input_grad_only``): layers ``m+1..L`` run `layers.training` where it supports them (the same values, dropout
    draws and gradients, parameters included; no double backward through them). Packed rows stay packed from layer
    to layer up to the last (`layers.packing.carrying`), as in `capture`, where h_m is their unpacked form.
    ``repeat=K``: `h_tilde` stacks K variants of ``h_m`` along the batch (``[K·B, ...]``, variant k in rows
    ``k·B .. k·B+B−1``); the batch's inputs are tiled to match, so one pass runs K edited copies of the batch
    (`cat_fast.analysis.mediation`). Eval mode only.
    """
    model = orig_module(model)
    st = structure(model)
    check_trainable_forward(model, st)
    _check_resume(model, cap, h_tilde, repeat)
    m, L = cap.layer, st.num_layers
    restore_rng = same_dropout and cap.rng_state is not None and model.training
    device = h_tilde.device
    saved_rng = get_rng_state(device) if restore_rng else None
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
                    out = replace_first(out, h_tilde)
                    if restore_rng:
                        set_rng_state(device, cap.rng_state)
                    if cap.rng_marker is not None:
                        cap.rng_marker(cap.rng_offset)
                return out
            if k == m:
                args, kwargs = _with_hidden(args, kwargs, cap.hidden_loc, h_tilde)
                if restore_rng:
                    set_rng_state(device, cap.rng_state)
                if cap.rng_marker is not None:
                    cap.rng_marker(cap.rng_offset)
            if k == L - 1 and first_token:
                out = layers.first_token.forward(mod, args, kwargs, first_token_fill, first_token_row_only,
                                                 input_only=input_grad_only)
            elif cap.last_output is not None and (input_grad_only or training_layers):
                # input_grad_only: the training layer where the rows are packed (the clean forward's training
                # layers packed them, and drew their dropout over them), else `layers.resumed`
                out = layers.training.forward(mod, args, kwargs, packed_only=input_grad_only)
                if out is None and input_grad_only:
                    args, kwargs = fast_layers.unpacked(args), fast_layers.unpacked(kwargs)
                    out = layers.resumed.forward(mod, args, kwargs)
            else:
                out = None
            if out is None:
                return orig(*fast_layers.unpacked(args), **fast_layers.unpacked(kwargs))
            return replace_first(cap.last_output, out)

        return forward

    inputs = _resume_inputs(model, cap, attention_mask, repeat)
    # the training layers m+1..L-2 may hand packed rows on (`layers.packing.carry`), as the clean forward's did
    carried = None
    if (training_layers or input_grad_only) and len(st.layer_modules) == L:
        carried = fast_layers.carry_set(model, st, st.layer_modules[m:])
    try:
        for mod in st.layer_modules:
            patched.append(patch_forward(mod, layer_forward(mod)))
        if st.embeddings is not None and cap.embedding_output is not None:
            cached = _tile(cap.embedding_output, repeat) if repeat > 1 else cap.embedding_output
            patched.append(patch_forward(st.embeddings, lambda *a, **k: cached))
        with layers.packing.carrying(carried), uncompiled(model) as module:
            out = module(**inputs)
    finally:
        for saved in reversed(patched):
            unpatch_forward(saved)
        if restore_rng:
            set_rng_state(device, saved_rng)
    if calls["n"] != L:
        unsupported(model, f"its layer list '{st.layer_list_name}' was called {calls['n']} times when resuming, "
                     f"expected {L}")
    return out


def _check_resume(model, cap: Capture, h_tilde, repeat) -> None:
    """`resume`'s argument checks: ``repeat`` an integer >= 1 (eval mode when > 1), `h_tilde` shaped as ``h_m``
    (stacked `repeat` times)."""
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat: expected an integer >= 1, got {repeat!r}")
    if repeat > 1 and model.training:
        raise ValueError("resume(repeat > 1) runs in eval mode only (no dropout masks to replay for the copies)")
    want = (repeat * cap.hidden.shape[0],) + tuple(cap.hidden.shape[1:])
    if tuple(h_tilde.shape) != want:
        what = "of h_m" if repeat == 1 else f"of h_m stacked {repeat} times along the batch"
        raise ValueError(f"h_tilde must have the shape {what} {want}, got {tuple(h_tilde.shape)}")


def _with_hidden(args, kwargs, loc, hidden):
    """The layer call's ``(args, kwargs)`` with its hidden-states argument (at `loc`, `hidden_argument`'s second
    value) replaced by `hidden`."""
    kind, where = loc
    if kind == "arg":
        return (hidden,) + tuple(args[1:]), kwargs
    return args, dict(kwargs, **{where: hidden})


def _resume_inputs(model, cap: Capture, attention_mask, repeat: int) -> dict:
    """The model inputs of a resumed pass: the captured ones, `attention_mask` in place of the batch's, tiled
    `repeat` times along the batch."""
    inputs = dict(cap.inputs)
    if attention_mask is not None:
        inputs = sync_free_inputs(model, dict(inputs, attention_mask=attention_mask))
    if repeat > 1:
        inputs = {k: _tile(v, repeat) for k, v in inputs.items()}
    return inputs


def _tile(value, k):
    if isinstance(value, torch.Tensor) and value.dim() >= 1:
        return value.repeat(k, *([1] * (value.dim() - 1)))
    if isinstance(value, tuple):
        return tuple(_tile(v, k) for v in value)
    return value


def head_logits(model, cap: Capture, x: torch.Tensor, *, same_dropout: bool = True):
    """Logits of the classification projection re-run on a pooled representation `x` [B, D].

    Needs ``capture(..., pooled=True)``. Differentiable w.r.t. `x` and the head's parameters. With
    ``same_dropout`` the head draws the dropout masks of the captured forward; it runs under the autocast state
    the model's own forward ran it under (mixed precision applied inside the forward by a wrapper included).
    """
    model = orig_module(model)
    st = structure(model)
    if cap.head_input is None:
        raise ValueError("head_logits needs capture(..., pooled=True)")
    inp = cap.head_input
    if inp.dim() == 3:
        inp = torch.cat([x.unsqueeze(1), inp[:, 1:]], dim=1)
    else:
        inp = x
    restore = same_dropout and cap.head_rng_state is not None and model.training
    saved = get_rng_state(x.device) if restore else None
    enabled, dtype = cap.head_autocast or (torch.is_autocast_enabled(x.device.type),
                                           torch.get_autocast_dtype(x.device.type))
    try:
        if restore:
            set_rng_state(x.device, cap.head_rng_state)
        if cap.rng_marker is not None:  # where the head's RNG state is (or, inside a capture, would be) restored
            cap.rng_marker(cap.head_rng_offset)
        with torch.autocast(x.device.type, dtype=dtype, enabled=enabled):
            return st.head(inp)
    finally:
        if restore:
            set_rng_state(x.device, saved)


def grad_wrt_pooled(score: torch.Tensor, cap: Capture, *, create_graph: bool) -> torch.Tensor:
    """``∇_x score`` for the captured pooled representation x ([B, D]); `score` a scalar of the clean forward."""
    if cap.head_input is None:
        raise ValueError("grad_wrt_pooled needs capture(..., pooled=True)")
    (g,) = torch.autograd.grad(score, cap.head_input, create_graph=create_graph, retain_graph=True)
    return g[:, 0] if g.dim() == 3 else g
