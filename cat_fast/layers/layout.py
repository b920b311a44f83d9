"""Where the parts of an encoder layer live, per architecture family, and the helpers the fast layers share.

`LAYOUTS` is the one per-family table (one `Layout` per family: everything cat_fast knows about it);
`family(layer)` recognises a layer by its structure, `component(layer, name)` returns the module whose output is one
of the mediators of `COMPONENTS`, `producer(layer, name)` the parameters that make it, `pieces(layer)` the layer as
pieces that run on chosen rows (mediation, the first-token layer). The fast layers (`layers.training`,
`layers.resumed`, `layers.first_token`) read the Bert layout's weights directly (`projection`, a peft LoRA Linear's
as W + s·BA); `plain` says when that computes what calling the modules would.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import casts

__all__ = ["Layout", "LAYOUTS", "MODEL_TYPES", "COMPONENTS", "BertParts", "Pieces", "family", "config_family",
           "component", "producer", "pieces", "bert_parts", "call_arguments", "plain", "sdpa_mask", "dropout",
           "dropout_p", "norm_forward", "fp32_mm_supported", "attach_copy16", "copy16", "bert_projections",
           "compute_dtype", "mm_at", "lora", "lora_refusal", "projection"]

# The activations a layer exposes to interventions (`layers.interventions`), in the order a forward computes them:
# the query, key and value projections, the attention block's output (after its LayerNorm), the feed-forward
# activation (after GELU) and the layer's output (after its LayerNorm).
COMPONENTS = ("query", "key", "value", "attention_output", "intermediate", "output")


@dataclass(frozen=True)
class Layout:
    """Everything cat_fast knows about one family of encoder layers; paths are dotted, relative to the layer.

    Adding a family is one entry of `LAYOUTS` (and its tests): recognition (`family`), interventions and masking
    (`component`), unlearning (`producer`), mediation's row-wise pieces and the first-token layer (`Pieces`) all
    read it from there."""

    model_types: tuple  # Hugging Face model types whose encoder layers have this layout
    # recognition (`family`): a layer of the family has these, and no chunked feed-forward
    linears: tuple  # paths that are nn.Linear
    norms: tuple  # paths that are nn.LayerNorm
    required: tuple  # other paths (modules or methods) that exist
    chunking: str  # module whose chunk_size_feed_forward must be 0 ("": the layer)
    attention: str  # the module holding the head count, head width, scaling and attention dropout
    heads: str  # attribute of `attention`: number of heads
    head_width: str  # attribute of `attention`: width of one head
    # the modules whose outputs are the mediators of `COMPONENTS`
    query: str
    key: str
    value: str
    attention_output: str  # module whose output is the attention block's output (after its LayerNorm)
    intermediate: str  # module whose output is the feed-forward activation
    output: str  # module whose output is the layer's output (after its LayerNorm)
    # component -> (the Linear whose output row makes the neuron, the LayerNorm after it or None)
    producers: dict
    # the row-wise pieces (`Pieces`), each calling the layer's own modules
    attention_block: Callable  # (layer, context, residual) -> the attention block's output
    activation: Callable  # (layer, attention block output) -> the feed-forward activation
    output_block: Callable  # (layer, activation, attention block output) -> the layer's output
    feed_forward: Callable  # (layer, attention block output) -> the layer's output, as the layer calls its modules
    inner_size: str  # config attribute: the feed-forward width
    fused: bool  # its weights are read directly (`bert_parts`: training, resumed, one-matmul keys and values)


def _bert_attention_block(layer, context, x):
    return layer.attention.output(context, x)


def _bert_output_block(layer, i, a):
    return layer.output(i, a)


def _distilbert_attention_block(layer, context, x):
    return layer.sa_layer_norm(layer.attention.out_lin(context) + x)


def _distilbert_activation(layer, a):
    return layer.ffn.activation(layer.ffn.lin1(a))


def _distilbert_output_block(layer, i, a):
    return layer.output_layer_norm(layer.ffn.dropout(layer.ffn.lin2(i)) + a)


def _distilbert_feed_forward(layer, a):
    return layer.output_layer_norm(layer.ffn(a) + a)


LAYOUTS = {
    # BERT, RoBERTa, ELECTRA, XLM-R, CamemBERT, MiniLM
    "bert": Layout(
        model_types=("bert", "roberta", "xlm-roberta", "electra", "camembert"),
        linears=("attention.self.query", "attention.self.key", "attention.self.value"), norms=(),
        required=("attention.output", "feed_forward_chunk"), chunking="",
        attention="attention.self", heads="num_attention_heads", head_width="attention_head_size",
        query="attention.self.query", key="attention.self.key", value="attention.self.value",
        attention_output="attention.output", intermediate="intermediate", output="output",
        producers={"query": ("attention.self.query", None), "key": ("attention.self.key", None),
                   "value": ("attention.self.value", None),
                   "attention_output": ("attention.output.dense", "attention.output.LayerNorm"),
                   "intermediate": ("intermediate.dense", None), "output": ("output.dense", "output.LayerNorm")},
        attention_block=_bert_attention_block, activation=lambda layer, a: layer.intermediate(a),
        output_block=_bert_output_block, feed_forward=lambda layer, a: layer.feed_forward_chunk(a),
        inner_size="intermediate_size", fused=True),
    "distilbert": Layout(
        model_types=("distilbert",),
        linears=("attention.q_lin", "attention.k_lin", "attention.v_lin", "attention.out_lin"),
        norms=("sa_layer_norm", "output_layer_norm"), required=("ffn",), chunking="ffn",
        attention="attention", heads="n_heads", head_width="attention_head_size",
        query="attention.q_lin", key="attention.k_lin", value="attention.v_lin",
        attention_output="sa_layer_norm", intermediate="ffn.activation", output="output_layer_norm",
        producers={"query": ("attention.q_lin", None), "key": ("attention.k_lin", None),
                   "value": ("attention.v_lin", None), "attention_output": ("attention.out_lin", "sa_layer_norm"),
                   "intermediate": ("ffn.lin1", None), "output": ("ffn.lin2", "output_layer_norm")},
        attention_block=_distilbert_attention_block, activation=_distilbert_activation,
        output_block=_distilbert_output_block, feed_forward=_distilbert_feed_forward,
        inner_size="hidden_dim", fused=False),
}

# Hugging Face model types whose encoder layers have a layout of `LAYOUTS` (`family` decides from the structure).
MODEL_TYPES = {t: kind for kind, spec in LAYOUTS.items() for t in spec.model_types}


def _get(module, path):
    for name in path.split(".") if path else ():
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


def lora(module) -> bool:
    """Whether `module` is a peft adapter wrapper of the LoRA kind (base layer, A and B, scaling, dropout)."""
    return type(module).__module__.startswith("peft.") and all(
        hasattr(module, n) for n in ("base_layer", "lora_A", "lora_B", "scaling", "lora_dropout", "active_adapters"))


def _adapter(module):
    """(the one active adapter of a LoRA wrapper that its forward runs, None) or (None, why not one)."""
    if module.disable_adapters or module.merged:
        return None, "adapters disabled" if module.disable_adapters else "adapters merged"
    names = [n for n in module.active_adapters if n in module.lora_A]
    return (names[0], None) if len(names) == 1 else (None, f"{len(names)} active adapters")


def lora_refusal(module) -> str | None:
    """Why the fast layers cannot read the peft wrapper `module` as one weight and bias now (`projection`), or None
    when they can or it is no peft module: a LoRA Linear over an nn.Linear, one active adapter, not merged, no DoRA or
    other variant, no LoRA bias, fan_in_fan_out off, A and B of the base weight's dtype, no dropout (p = 0 or eval)."""
    kind = type(module)
    if not kind.__module__.startswith("peft."):
        return None
    if f"{kind.__module__}.{kind.__name__}" != "peft.tuners.lora.layer.Linear" or type(module.base_layer) is not nn.Linear:
        return f"peft's {kind.__name__} (only LoRA Linears over an nn.Linear are read)"
    name, why = _adapter(module)
    if why is not None or getattr(module, "fan_in_fan_out", False):
        return why or "fan_in_fan_out"
    if getattr(module, "use_dora", {}).get(name) or name in getattr(module, "lora_variant", {}):
        return "DoRA" if getattr(module, "use_dora", {}).get(name) else "a LoRA variant"
    a, b, drop, w = module.lora_A[name], module.lora_B[name], module.lora_dropout[name], module.base_layer.weight
    if type(a) is not nn.Linear or type(b) is not nn.Linear or a.bias is not None or b.bias is not None:
        return "a LoRA bias"
    if not a.weight.dtype == b.weight.dtype == w.dtype:
        return f"adapter weights in {a.weight.dtype}, the base weight in {w.dtype}"
    if type(drop) is not nn.Identity and not (type(drop) is nn.Dropout and (drop.p == 0 or not drop.training)):
        return f"lora_dropout {getattr(drop, 'p', type(drop).__name__)} in training mode"
    return None


def projection(module) -> tuple:
    """``(weight, bias)`` the fast layers apply for `module` (a Linear, a LayerNorm): its parameters, or for a LoRA
    wrapper that `lora_refusal` accepts ``W + scaling · B @ A`` (made now: autograd reaches A and B) and W's bias."""
    if not lora(module):
        return module._parameters["weight"], module._parameters["bias"]
    name, base = _adapter(module)[0], module.base_layer
    return base.weight + module.lora_B[name].weight @ module.lora_A[name].weight * module.scaling[name], base.bias


def _has(layer, spec: Layout) -> bool:
    attention, chunked = _get(layer, spec.attention), _get(layer, spec.chunking)
    return (attention is not None and all(hasattr(attention, n) for n in (spec.heads, spec.head_width))
            and all(isinstance(m, nn.Linear) or (lora(m) and type(m.base_layer) is nn.Linear)
                    for m in (_get(layer, p) for p in spec.linears))
            and all(isinstance(_get(layer, p), nn.LayerNorm) for p in spec.norms)
            and all(_get(layer, p) is not None for p in spec.required)
            and chunked is not None and getattr(chunked, "chunk_size_feed_forward", 0) == 0)


def family(layer: nn.Module) -> str | None:
    """The name of the `LAYOUTS` family of `layer` when it is a post-LN encoder layer of one (no cross-attention, no
    chunked feed-forward), else None."""
    if getattr(layer, "is_decoder", False) or getattr(layer, "add_cross_attention", False):
        return None
    return next((kind for kind, spec in LAYOUTS.items() if _has(layer, spec)), None)


def config_family(config) -> str | None:
    """The `LAYOUTS` family of a Hugging Face config's model type, or None."""
    model_type = getattr(config, "model_type", None)
    return next((kind for kind, spec in LAYOUTS.items() if model_type in spec.model_types), None)


def _layout_of(layer, who) -> Layout:
    kind = family(layer)
    if kind is None:
        raise ValueError(f"{who}: {type(layer).__name__} has no layout cat_fast knows ({', '.join(LAYOUTS)})")
    return LAYOUTS[kind]


def component(layer: nn.Module, name: str) -> nn.Module:
    """The module of `layer` whose output is the mediator `name` (one of `COMPONENTS`)."""
    if name not in COMPONENTS:
        raise ValueError(f"component: expected one of {COMPONENTS}, got {name!r}")
    return _get(layer, getattr(_layout_of(layer, "component"), name))


def producer(layer: nn.Module, name: str) -> tuple:
    """``(linear, norm or None)``: the Linear of `layer` whose output row makes each neuron of the mediator `name`,
    and the LayerNorm after it (attention_output, output)."""
    if name not in COMPONENTS:
        raise ValueError(f"component: expected one of {COMPONENTS}, got {name!r}")
    linear, norm = _layout_of(layer, "producer").producers[name]
    return _get(layer, linear), (None if norm is None else _get(layer, norm))


class Pieces:
    """One encoder layer of a `LAYOUTS` family called in pieces, on chosen rows, with its own modules: the
    projections, `attend`, the attention block (`attended`), the feed-forward activation (`intermediate`) and output
    block (`output`), and `finish` (all that follows attention, as the layer calls its modules)."""

    def __init__(self, layer: nn.Module, kind: str):
        self.layer, self.spec = layer, LAYOUTS[kind]
        self.attention = _get(layer, self.spec.attention)
        self.query, self.key, self.value = (_get(layer, p) for p in (self.spec.query, self.spec.key, self.spec.value))
        self.heads = getattr(self.attention, self.spec.heads)
        self.width = getattr(self.attention, self.spec.head_width)

    def attended(self, context, x):
        return self.spec.attention_block(self.layer, context, x)

    def intermediate(self, a):
        return self.spec.activation(self.layer, a)

    def output(self, i, a):
        return self.spec.output_block(self.layer, i, a)

    def finish(self, context, x):
        """The layer's output from the attention context and the layer's input rows (the residual)."""
        return self.spec.feed_forward(self.layer, self.attended(context, x))

    def attend(self, q, k, v, mask):
        """Attention context [N, tq, D] of queries q [N, tq, D] over keys / values [N, t, D]; `mask` a 4-D mask that
        broadcasts to [N, 1, tq, t] (or None)."""
        n, tq, _ = q.shape
        t = k.shape[1]
        q = q.reshape(n, tq, self.heads, self.width).transpose(1, 2)
        k, v = (x.reshape(n, t, self.heads, self.width).transpose(1, 2) for x in (k, v))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask(mask, q.dtype),
                                                 scale=self.attention.scaling)
        return context.transpose(1, 2).reshape(n, tq, self.heads * self.width)


def pieces(layer: nn.Module) -> Pieces | None:
    """`Pieces` of `layer`, or None when it has no layout of `LAYOUTS`."""
    kind = family(layer)
    return None if kind is None else Pieces(layer, kind)


class BertParts(NamedTuple):
    """The four blocks of a Bert-layout layer whose weights the fast layers read."""

    self_attention: nn.Module  # .query / .key / .value, heads, width, scaling, attention dropout
    attention_output: nn.Module  # .dense, .dropout, .LayerNorm
    intermediate: nn.Module  # .dense, .intermediate_act_fn
    output: nn.Module  # .dense, .dropout, .LayerNorm


def bert_parts(layer: nn.Module) -> BertParts | None:
    try:
        return BertParts(layer.attention.self, layer.attention.output, layer.intermediate, layer.output)
    except AttributeError:
        return None


def bert_projections(layer: nn.Module) -> tuple:
    """A Bert-layout layer's twelve projection parameters in `casts.weights`'s order: query, key and value weights,
    their biases, then the attention output, intermediate and output projections' weight and bias."""
    sa, so, inter, out = bert_parts(layer)
    (wq, bq), (wk, bk), (wv, bv) = (projection(m) for m in (sa.query, sa.key, sa.value))
    return (wq, wk, wv, bq, bk, bv, *projection(so.dense), *projection(inter.dense), *projection(out.dense))


def call_arguments(args, kwargs, tokens: int | None = None):
    """(hidden_states [B, T, D], attention_mask: None or 4-D over T keys) of a layer call, or None when the call
    passes anything else; `tokens`: T when the hidden states are packed rows [1, N, D] (`packing.carried`)."""
    names = ("hidden_states", "attention_mask", "encoder_hidden_states")
    if len(args) > len(names):
        return None
    values = dict(zip(names, args))
    values.update(kwargs)
    extra = {k: v for k, v in values.items() if k not in names[:2]}
    if any(v is not None and v is not False for v in extra.values()):
        return None  # cross-attention inputs, caches, attention outputs requested...
    x, mask = values.get("hidden_states"), values.get("attention_mask")
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return None
    if mask is not None and (mask.dim() != 4 or mask.shape[-1] != (x.shape[1] if tokens is None else tokens)):
        return None
    return x, mask


_PLAIN_TYPES = (nn.Linear, nn.LayerNorm, nn.Dropout)


def _user_hooks(hooks) -> bool:
    """Whether `hooks` holds any hook but Hugging Face's output recorders (installed on the model once outputs
    are requested; they record nothing unless a call requests outputs, and cat_fast's passes do not) and
    cat_fast's own interventions (which the fast layers apply themselves)."""
    return any(not (getattr(h, "__module__", None) or "").startswith("transformers.utils.")
               and not getattr(h, "cat_fast_intervention", False) for h in hooks.values())


def plain(*modules: nn.Module) -> bool:
    """Whether code that reads these modules' weights (instead of calling them) computes what calling them
    would: each is exactly a torch.nn Linear / LayerNorm / Dropout or a container of no other behaviour, none has
    its forward replaced on the instance, and neither they nor any module (global hooks) has forward hooks that a
    call would run (cat_fast's interventions excepted: the fast layers apply them)."""
    mm = nn.modules.module
    if any(_user_hooks(getattr(mm, name, {})) for name in ("_global_forward_hooks", "_global_forward_pre_hooks")):
        return False
    return all(not _user_hooks(m._forward_hooks) and not _user_hooks(m._forward_pre_hooks)
               and "forward" not in m.__dict__  # a forward replaced on the instance (offloading wrappers, ...)
               and (type(m) in _PLAIN_TYPES or not isinstance(m, _PLAIN_TYPES)) for m in modules)


def sdpa_mask(mask, dtype):
    """The attention mask as the fast layers hand it to SDPA: a boolean mask in its additive form (`casts.additive_mask`:
    the same attention, converted once per step instead of inside every SDPA call), another one in `dtype`."""
    if mask is None:
        return None
    return casts.additive_mask(mask, dtype) if mask.dtype == torch.bool else mask.to(dtype)


def dropout_p(module):
    """The dropout probability `module` applies now (0 in eval mode); None when it is not in [0, 1)."""
    p = float(module.p) if module.training else 0.0
    return p if 0.0 <= p < 1.0 else None


def dropout(x, p):
    """``(x with dropout, what its backward needs or None)`` with the draws of ``F.dropout`` on x's device:
    `torch.native_dropout` (keep mask) on CUDA, the Bernoulli noise of ``torch.dropout``'s CPU kernel (the scaled
    keep mask) elsewhere."""
    if p == 0.0:
        return x, None
    if x.is_cuda:
        return torch.native_dropout(x, p, True)
    noise = torch.empty_like(x).bernoulli_(1.0 - p).div_(1.0 - p)
    return x * noise, noise


def norm_forward(rln, branch, residual, weight, bias, eps, p, key, stream, dtype):
    """``(branch as the backward takes it, keep, y, y16, mean, rstd)`` of ``LayerNorm(dropout(branch) + residual)``
    by the fused kernels `rln` (`kernels.triton.residual_layer_norm`): the dropout drawn in the kernel from `key` and
    `stream` where a key is given and p > 0 (the branch kept as projected: the backward's ``raw=True``), else by
    `dropout` first."""
    if key is not None and p > 0:
        y, y16, mean, rstd, keep = rln.forward_with_dropout(branch, residual, weight, bias, eps, p, key, stream,
                                                            out16_dtype=dtype)
        return branch, keep, y, y16, mean, rstd
    branch, keep = dropout(branch, p)
    return (branch, keep, *rln.forward(branch, residual, weight, bias, eps, out16_dtype=dtype))


def fp32_mm_supported(device) -> bool:
    """Whether matmuls of 16-bit inputs can write an fp32 output (``out_dtype``) on `device`."""
    return device.type == "cuda"


def attach_copy16(out: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
    """Hand `copy` — `out` rounded to a 16-bit dtype, written by the kernel that wrote `out` — to the next fast
    layer, whose input `out` is (`copy16`): it then skips its own cast. Returns `out`."""
    out._cat_fast_copy16 = (copy, out._version)
    return out


def copy16(x: torch.Tensor, dtype) -> torch.Tensor:
    """``x.to(dtype)``: the copy a fast layer attached to its output `x` (`attach_copy16`) while x is unchanged
    since (its version counter) and the copy has x's shape and `dtype`, else a cast."""
    found = getattr(x, "_cat_fast_copy16", None)
    if found is not None and found[1] == x._version and found[0].dtype == dtype and found[0].shape == x.shape:
        return found[0]
    return x.to(dtype)


def compute_dtype(hidden: torch.Tensor, param_dtype) -> torch.dtype | None:
    """The matmul dtype of a fast layer's pass: autocast's for an fp32 layer under autocast (the mixed-precision
    setting, where the layer norms run in fp32 as autocast runs them), else the one dtype of input and parameters;
    None otherwise (other autocast combinations run the layer itself)."""
    if torch.is_autocast_enabled(hidden.device.type):
        fp32 = hidden.dtype == param_dtype == torch.float32
        return torch.get_autocast_dtype(hidden.device.type) if fp32 else None
    return hidden.dtype if hidden.dtype == param_dtype else None


def will_run(node) -> bool:
    """Whether the running backward will execute the autograd `node` (an input's grad_fn or gradient edge): False
    where ``torch.autograd.grad(..., inputs)`` leaves it out, so a backward can skip work nobody reads; True where
    PyTorch cannot say (outside the engine, an older PyTorch, a leaf that ``autograd.grad`` was asked for)."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (AttributeError, RuntimeError):
        return True


def mm_at(a: torch.Tensor, b: torch.Tensor, dtype) -> torch.Tensor:
    """``a @ b`` in `dtype`: 16-bit factors accumulated into an fp32 result by the matmul itself where the device
    can (`fp32_mm_supported`), else the product rounded to `dtype`."""
    if fp32_mm_supported(a.device) and dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).to(dtype)
