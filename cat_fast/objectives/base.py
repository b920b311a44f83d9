"""The common shape of cat_fast's training objectives, and the registry that names them.

An objective is called once per training step: ``loss, info = objective(batch)`` (``objective(batch, pairs)``
for those that take counterfactual pairs), with ``loss`` a 0-d tensor to back-propagate and ``info`` a dict of
detached 0-d tensors to log (no host synchronisation inside the step). A new method subclasses `Objective` and
provides:

- ``__init__(model, ...)``: its hyper-parameters, checked there (``ValueError`` naming the argument);
- ``__call__(batch)``: the loss and info of one step (the base checks first that the batch has the targets,
  `Objective.target_keys`: a ValueError naming the missing key; override ``target_keys`` for other targets);
- optionally ``parameters()`` (trainable tensors the objective owns, e.g. a learned gate: give them to the
  optimizer), ``state_dict()`` / ``load_state_dict()`` (what a checkpoint keeps; default: ``step``),
  ``set_optimizer(optimizer)`` (an objective that steps an optimizer itself), and ``from_options`` (how the
  CLI's flat options map to its arguments; default: the preset only);
- optionally ``check_distributed()`` (raise a ValueError naming an option that cannot run under DDP) and
  ``distributed_state()`` (tensors that must start equal on every rank); an inner optimizer step goes through
  ``inner_update(loss, optimizer)``, which averages its gradients over the ranks under DDP;
- its declarations (`config`: ``config`` — its options, from which the CLI makes its flags and a checkpoint its
  record —, ``requires`` — the batch columns and arguments it needs, e.g. `config.PAIRS` —, ``curves`` — the info
  keys ``curves.png`` draws); no layer above it knows it by name;
- for a step replayable as one CUDA graph (`cat_fast.step.CapturedStep`): ``capture_key`` returning ``()`` when the
  step holds nothing host-side, or, when it draws or counts on the host, ``plan_step`` (those decisions, made before
  the step, as a `cat_fast.step.StepPlan`; raise `NotCapturable` with the reason, before changing any state, for a
  step that cannot be replayed) and ``planned_step`` (the step with those decisions; everything in it must run on
  the device: no host reads of tensors, no new buffers replacing old ones, passes that redraw earlier dropout
  through `cat_fast.models.PassGenerators` inside a capture). Its eager result must equal ``__call__``'s: the CPU
  tests compare them.

Under DistributedDataParallel (`cat_fast.distributed`), ``distributed`` is True and the objective runs inside the
DDP module's forward; its model is always the unwrapped one (``.module``). An objective built on a DDP module
(``CAT(ddp)``, also inside or around torch.compile's wrapper) keeps it as ``ddp``, is prepared for it once its
constructor has run (`cat_fast.distributed.prepare_objective`), and every call runs inside its forward (the base
wraps a subclass's ``__call__``); ``plan_step`` refuses any step under DDP (`NotCapturable`).

Compiled models are accepted: ``torch.compile(model)``, ``model.compile()`` and either inside or around DDP. The
objective's ``model`` is then the original module (`cat_fast.models.unwrap`: torch.compile's ``._orig_mod``), and
every pass that hooks or patches it (captures, resumed layers, first-token and fast layers, CUDA graphs, GS's
passes inside the backward) runs its own forward, never the compiled graph (`cat_fast.models.uncompiled`): the
losses and gradients are exactly those of the uncompiled model. Only a plain forward, which nothing of the objective
hooks or patches (`plain_forward`: ERM's loss, CAT's warm-up and alternate ERM step without first-token pruning),
runs the compiled model: torch.compile's wrapper around the model (``compiled_model``; the Trainer integration sets
it to the wrapper its ``torch_compile=True`` made), or the model compiled in place. Its values are the compiled
model's, as without cat_fast (inductor rounds differently and draws its own dropout masks).

Then one `register` line names it for the CLI (``cat-fast train --method NAME``) and the Trainer classes; a package
outside cat_fast registers through ``cat_fast.objectives.register`` or the ``cat_fast.objectives`` entry-point group
(loaded by `names` / `get` on first use): the entry point names the method and loads its `Objective` subclass
(registered with the class attribute ``registry``, a dict of `register`'s keywords) or a function that calls
`register` itself.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Mapping

import torch

from ..distributed import ddp_module, prepare_objective, run_in_forward
from ..layers import packing
from ..models.inputs import declare_batch_keys
from ..step import NotCapturable, StepPlan
from .config import PAIRS, Declarations, missing_arguments

__all__ = ["Objective", "Entry", "register", "get", "names", "build", "check_number", "ENTRY_POINTS"]

ENTRY_POINTS = "cat_fast.objectives"  # the entry-point group of objectives written outside cat_fast


def check_number(name: str, value, *, low=None, high=None, low_open=False, integer=False) -> float:
    """`value` as a float (int with ``integer``) after checking it is a finite number in [low, high] (``low_open``:
    (low, high]); otherwise a ValueError / TypeError naming `name` and the range expected."""
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
        raise TypeError(f"{name}: expected {kind}, got {value!r}")
    value = float(value)
    bounds = ("(" if low_open else "[") + ("-inf" if low is None else f"{low:g}") + ", " + (
        "inf" if high is None else f"{high:g}") + ("]" if high is not None else ")")
    if (value != value or value in (float("inf"), float("-inf")) or (low is not None and (value < low or (
            low_open and value == low))) or (high is not None and value > high)):
        raise ValueError(f"{name}: expected a finite number in {bounds}, got {value}")
    return int(value) if integer else value


def _checks_batch(method):
    """`method` (an objective's ``__call__`` or ``plan_step``) after `Objective.check_batch` on its batch."""
    @functools.wraps(method)
    def checked(self, batch, *args, **kwargs):
        self.check_batch(batch)
        return method(self, batch, *args, **kwargs)

    return checked


def _under_ddp(name, method):
    """`method` (an objective's ``__call__`` or ``plan_step``) for an objective that may train under DDP: a call
    of one built on a DDP module runs inside its forward (`cat_fast.distributed.run_in_forward`); a plan under
    DDP is refused (`Objective.check_capturable`)."""
    if name == "plan_step":
        @functools.wraps(method)
        def planned(self, *args, **kwargs):
            self.check_capturable()
            return method(self, *args, **kwargs)

        return planned

    @functools.wraps(method)
    def routed(self, *args, **kwargs):
        ddp = getattr(self, "ddp", None)
        if ddp is None or getattr(self, "_in_ddp_forward", False):
            return method(self, *args, **kwargs)

        def inside(*a, **k):  # DDP's forward: the passes run here, and a nested call runs directly
            self._in_ddp_forward = True
            try:
                return method(self, *a, **k)
            finally:
                self._in_ddp_forward = False

        return run_in_forward(ddp, inside, *args, **kwargs)

    return routed


def _padded_unless_packing(method):
    """`method` (an objective's ``__call__`` or ``planned_step``) with nothing packed unless the objective declares
    `Objective.packs_rows` (`layers.packing.padded`)."""
    @functools.wraps(method)
    def scoped(self, *args, **kwargs):
        with packing.padded(not self.packs_rows):
            return method(self, *args, **kwargs)

    return scoped


class _ObjectiveType(type):
    """The objectives' type: an objective built on a DDP module is prepared for it once its whole constructor has
    run (its own parameters, generators and options exist then)."""

    def __call__(cls, *args, **kwargs):
        objective = super().__call__(*args, **kwargs)
        if getattr(objective, "ddp", None) is not None:
            prepare_objective(objective)
        return objective


class Objective(Declarations, metaclass=_ObjectiveType):
    """Base class of the training objectives (module docstring)."""

    find_unused_parameters = False  # DDP's setting for it: every step's loss reaches every parameter of the model
    # Whether its passes may run on the batch's real rows only (`layers.training.PACKED`): its forwards run the
    # encoder as training layers, and every pass that redraws the clean forward's dropout packs as the clean forward
    # did. A captured step then packs by default ("auto", `cat_fast.step`); an objective without it runs padded
    # whatever PACKED says (`layers.packing.padded`).
    packs_rows = False
    # The fewest rows (batch x length) from which a captured step packs its batch by default ("auto"), given
    # `packs_rows`; None: `layers.training.PACKED_MIN_ROWS`. Where packing was measured faster
    # (benchmarks/RESULTS.md); PACKED = True packs wherever `packs_rows` holds.
    packed_min_rows = None

    def packed_rows(self, batch, tensors):
        """The [B, T] boolean rows a packed step computes (`layers.packing.extended`) for the batch and the step
        plan's `tensors`, where they are more than the real tokens (CAT's); None: the real tokens."""
        return None

    def narrowed_rows(self, batch, tensors):
        """The [B, T] boolean rows, within `packed_rows`, that the layers past a narrowing pack
        (`layers.packing.narrow`: CAT's layers past its mixing layer); None: no narrowing."""
        return None

    # Whether the rows of `packed_rows` that are no real token take no gradient, so that a packed step carries them
    # apart, forward only, up to the narrowing (`layers.packing.lent`), its layers packing the real tokens there.
    lent_rows_apart = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in ("__call__", "plan_step"):  # every entry point of a step checks its batch first
            if name in cls.__dict__:
                setattr(cls, name, _checks_batch(_under_ddp(name, cls.__dict__[name])))
        for name in ("__call__", "planned_step"):
            if name in cls.__dict__:
                setattr(cls, name, _padded_unless_packing(cls.__dict__[name]))
        declare_batch_keys(*cls.batch_columns())  # never passed to the model's forward

    def pairs_required(self) -> bool:
        """Its batches must carry counterfactual pairs (`config.PAIRS`, unless it draws its own partners)."""
        return PAIRS in self.requires and not self.random_pairs

    def call_arguments(self, batch):
        """``(batch, args)`` of a step's call for a batch with every column (`config.PAIRS`): the pairs, from
        ``pairs`` (a partner's index in the batch, -1 = none) or ``pair_group`` (an id per example), as an argument
        of an objective that requires them, and the batch without those columns; the batch alone otherwise."""
        if PAIRS not in self.requires:
            return batch, ()
        from .gs_pairs import pair_by_group

        pairs = batch.get("pairs")
        if pairs is None and "pair_group" in batch:
            pairs = pair_by_group(batch["pair_group"])
        if pairs is None and not self.random_pairs:
            raise ValueError(f"{type(self).__name__} needs a 'pairs' or 'pair_group' column in the batch "
                             "(or random_pairs=True)")
        return {k: v for k, v in batch.items() if k not in PAIRS.columns}, (pairs,)

    def target_keys(self) -> tuple:
        """The keys every batch must carry besides the model's inputs: the targets of the loss, ``labels`` (class
        indices [B]), or for a ``*ForQuestionAnswering`` model ``start_positions`` and ``end_positions``."""
        if type(getattr(self, "model", None)).__name__.endswith("ForQuestionAnswering"):
            return ("start_positions", "end_positions")
        return ("labels",)

    def check_batch(self, batch) -> None:
        """A ValueError naming the objective and the missing key unless the batch (a mapping: the model's inputs
        and the targets) has every key of `target_keys`."""
        who = type(self).__name__
        missing = [k for k in self.target_keys() if k not in batch] if isinstance(batch, Mapping) else []
        if missing:
            raise ValueError(f"{who}: the batch has no {missing[0]!r}; {who} needs the model's inputs plus "
                             f"{' and '.join(map(repr, self.target_keys()))} (the targets of its loss: "
                             f"{'class indices [B]' if missing[0] == 'labels' else 'answer token positions [B]'})")

    def __init__(self, model):
        from ..models import compiled_wrapper, unwrap

        self.model = unwrap(model)  # a DDP- or torch.compile-wrapped model: the objective drives the model inside it
        self.compiled_model = compiled_wrapper(model)  # torch.compile's wrapper of self.model, if given: plain_forward
        self.ddp = ddp_module(model)  # the DDP module it was built on, if any: each call runs inside its forward
        self.step = 0  # calls so far; the trainers set it to the optimizer step (warm-ups count in it)
        self.distributed = False  # set by cat_fast.distributed.prepare_objective: inner updates all-reduce

    def check_capturable(self) -> None:
        """`NotCapturable` under DDP: a step replayed as a CUDA graph would run outside DDP's forward and reducer,
        so its gradients would not be averaged over the ranks; except inside `cat_fast.step.CapturedStep`, which
        plans and runs such a step outside DDP's forward and averages the gradients itself (`cat_fast.step_ddp`)."""
        if self.distributed and not getattr(self, "_averaged_by_step", False):
            raise NotCapturable(f"{type(self).__name__} under DistributedDataParallel: a replayed step would skip "
                                "DDP's forward and gradient averaging; use cat_fast.step.CapturedStep, which "
                                "averages them itself, or call the objective in a plain loop")

    def check_distributed(self) -> None:
        """Raise a ValueError naming the option when this objective cannot train under DDP (none by default)."""

    def distributed_state(self) -> list:
        """Tensors besides `parameters()` that must start equal on every rank (broadcast from rank 0)."""
        return []

    def inner_update(self, loss, optimizer) -> None:
        """One step of `optimizer` on the gradients of `loss` alone (the caller's ``.grad`` left as it was): an
        objective's extra update inside its call (CAT's alternating CRM step, ``erm-two-step``). Under DDP these
        gradients are averaged over the ranks before the step (it runs inside DDP's forward, where DDP's reducer
        does not act), so parameters stay identical on every rank."""
        params = [q for q in self.model.parameters() if q.requires_grad]
        known = {id(q) for q in params}
        params += [q for group in optimizer.param_groups for q in group["params"]
                   if q.requires_grad and id(q) not in known]
        stash = [q.grad for q in params]
        for q in params:
            q.grad = None
        try:
            loss.backward()
            if self.distributed:  # (a parameter this loss does not reach keeps no gradient, on every rank alike)
                from ..distributed import all_reduce_mean_

                all_reduce_mean_([q.grad for q in params])
            optimizer.step()
        finally:
            for q, g in zip(params, stash):
                q.grad = g

    def __call__(self, batch):
        raise NotImplementedError

    def plain_forward(self, inputs):
        """``model(**inputs)`` for a forward that nothing of the objective hooks or patches: through torch.compile's
        wrapper when there is one (``compiled_model``), else the model itself (compiled in place or not)."""
        model = self.compiled_model if self.compiled_model is not None else self.model
        return model(**inputs)

    def parameters(self):
        """Trainable tensors the objective owns (none by default)."""
        return []

    def state_dict(self) -> dict:
        """``step`` and, for an objective with a ``generator``, its state (what a resumed run needs to draw the
        same numbers)."""
        state = {"step": self.step}
        for name in ("generator", "layer_generator"):
            generator = getattr(self, name, None)
            if isinstance(generator, torch.Generator):
                state[name] = generator.get_state()
        return state

    def load_state_dict(self, state: Mapping) -> None:
        self.step = int(state.get("step", 0))
        for name in ("generator", "layer_generator"):
            generator = getattr(self, name, None)
            if name == "layer_generator" and generator is None and hasattr(self, name) and state.get(name) is not None:
                generator = self.layer_generator = torch.Generator()  # made under DDP: a resumed run restores it
            if isinstance(generator, torch.Generator) and state.get(name) is not None:
                generator.set_state(state[name])

    def capture_key(self, batch, *args):
        """What, besides the shapes of the batch, selects this step's CUDA graph in `cat_fast.step.CapturedStep` (a
        hashable; ``()`` for none), or `cat_fast.step.NotCapturable` with the reason when a step cannot be
        replayed: one that draws on the host, steps an optimizer itself or keeps host-side state per step (the
        default, until an objective says otherwise)."""
        raise NotCapturable(f"{type(self).__name__}: its step is not replayable as a CUDA graph yet (host-side "
                            "draws or state); run it with CapturedStep(..., cuda_graph=False)")

    def plan_step(self, batch, *args):
        """The host-side part of the next step, decided before it runs, as a `cat_fast.step.StepPlan` (what
        `cat_fast.step.CapturedStep` replays a graph for); `cat_fast.step.NotCapturable` when the step cannot be
        replayed. Planning a step may advance the objective's host state (its step counter, its generators): run
        the step with `planned_step`. The default plans nothing but ``capture_key``; a replayed step counts in
        ``step`` as a call does."""
        self.check_capturable()
        return StepPlan(key=self.capture_key(batch, *args), before_replay=self._count_replayed_step)

    def _count_replayed_step(self):
        self.step += 1

    def planned_step(self, plan, batch, *args):
        """``(loss, info)`` of the step that `plan` (from `plan_step`) describes. The default is the objective's
        own call (its plan holds nothing but a key)."""
        return self(batch, *args)

    def set_optimizer(self, optimizer) -> None:
        """Called by the trainers with their optimizer (for objectives that step one themselves)."""

    @classmethod
    def from_options(cls, model, options: Mapping, **preset):
        """An instance from the CLI's flat `options` (option name -> value) and a registry `preset`: by default its
        ``config`` read from `options` (checked), its fields as keyword arguments, the preset over them."""
        config = cls.config.from_options(options)
        config.check()
        return cls(model, **{**config.to_dict(), **preset})

    @classmethod
    def options_of(cls, options: Mapping) -> dict:
        """Its config's values in `options` (what a checkpoint records of it)."""
        return cls.config.from_options(options).to_dict()


@dataclass(frozen=True)
class Entry:
    """A registered objective: its class, preset arguments and what the CLI needs to know of it."""

    name: str
    cls: type
    summary: str
    preset: dict = field(default_factory=dict)
    data: str = "orig+edits"  # the training data the CLI uses by default: "orig" or "orig+edits"
    eager_attention: bool = False  # the CLI loads the model with eager attention (exact double backward)
    warmup: bool = False  # the CLI trains its first --warmup-epochs epochs with plain ERM


_REGISTRY: dict = {}


def check_single_label(config, who: str) -> None:
    """ValueError naming `who` unless `config` (a model's) is a single-label classifier: ``num_labels >= 2`` and
    ``problem_type`` unset or ``"single_label_classification"``."""
    problem = getattr(config, "problem_type", None)
    labels = getattr(config, "num_labels", None)
    if not isinstance(labels, int) or labels < 2 or problem not in (None, "single_label_classification"):
        raise ValueError(f"{who}: expected a single-label sequence classifier (num_labels >= 2, problem_type unset or "
                         f"'single_label_classification'); got num_labels={labels}, problem_type={problem!r}")


def register(name: str, cls: type, summary: str, *, data: str = "orig+edits", eager_attention: bool = False,
             warmup: bool = False, **preset) -> Entry:
    """Name an objective class with preset arguments (``register("cat-star", CAT, "...", adv_steps=0)``)."""
    if name in _REGISTRY:
        raise ValueError(f"objective {name!r} is registered already")
    if not (isinstance(cls, type) and issubclass(cls, Objective)):
        raise TypeError(f"cls: expected a subclass of cat_fast.objectives.Objective, got {cls!r}")
    if data not in ("orig", "orig+edits"):
        raise ValueError(f"data: expected 'orig' or 'orig+edits', got {data!r}")
    entry = Entry(name, cls, summary, dict(preset), data, eager_attention, warmup)
    _REGISTRY[name] = entry
    return entry


_plugins_loaded = False


def load_plugins() -> None:
    """Register the objectives of the ``cat_fast.objectives`` entry-point group, once (module docstring); a plugin
    that fails to load is a ValueError naming it."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    from importlib.metadata import entry_points

    for point in entry_points(group=ENTRY_POINTS):
        if point.name in _REGISTRY:
            continue
        try:
            loaded = point.load()
        except Exception as error:
            raise ValueError(f"objective plugin {point.name!r} ({point.value}): cannot load it "
                             f"({type(error).__name__}: {error})") from error
        if isinstance(loaded, type) and issubclass(loaded, Objective):
            doc = (loaded.__doc__ or loaded.__name__).strip().splitlines()[0]
            register(point.name, loaded, doc, **dict(getattr(loaded, "registry", {})))
        elif callable(loaded):
            loaded()
        else:
            raise ValueError(f"objective plugin {point.name!r} ({point.value}): expected an Objective subclass or a "
                             f"function that calls cat_fast.objectives.register, got {type(loaded).__name__}")


def names() -> tuple:
    """The registered objective names, in registration order (the entry-point plugins after cat_fast's own)."""
    load_plugins()
    return tuple(_REGISTRY)


def get(name: str) -> Entry:
    if name not in _REGISTRY:
        load_plugins()
    if name not in _REGISTRY:
        raise ValueError(f"objective: expected one of {', '.join(_REGISTRY)}, got {name!r}")
    return _REGISTRY[name]


def build(name: str, model, options: Mapping | None = None, **kwargs) -> Objective:
    """The objective `name` on `model`: its preset, then the CLI-style `options`, then `kwargs` (which win)."""
    entry = get(name)
    if options is None:
        missing = missing_arguments(entry.cls, {**entry.preset, **kwargs})
        if missing:
            raise ValueError(missing)
        return entry.cls(model, **{**entry.preset, **kwargs})
    return entry.cls.from_options(model, options, **{**entry.preset, **kwargs})
