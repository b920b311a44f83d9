"""CUDA graphs keyed by their inputs' signature: the one engine behind `cat_fast.step.CapturedStep` (a whole
training step) and CAT's CAL loop (`cat_fast.objectives.cat_graphs`).

``cache = GraphCache(max_graphs=8, limit_warning="... max_graphs={max_graphs} ...")``, then per call::

    sig = cache.signature(inputs, key)   # inputs: tensors, or dicts, tuples, lists of them and of plain values
    entry = cache.get(sig)               # the captured `Graphs`, or None
    if entry is None and cache.admit(sig, warmup=...):
        entry = cache.capture(sig, inputs, build, device=..., failed=...)
    if entry is None: ...run eagerly...
    entry.load(inputs); entry.replay("name"); entry.outputs["name"]

A signature is the inputs' structure with each tensor's shape, dtype and device (plain values by ``repr``), plus
`key`: whatever else the captured code depends on. Inputs enter through static copies, one set per input signature
(shared by every key with those inputs), which `Graphs.load` refreshes before a replay. `capture` calls
``build(static_inputs)`` for the code to capture (name → callable reading only the static inputs), runs each
callable ``warmup`` times on a side stream (lazy initialisations), then captures each into its own graph, all in
the cache's one memory pool, with garbage collection paused (a collection there could free another graph while
this one is captured). A capture that raises leaves None for its signature, with one warning per error type: that
signature runs eagerly from then on.

Bound: `admit` refuses new signatures once ``max_graphs`` are held (failed captures count), with one warning;
nothing is evicted, only `clear` (which also drops the static copies and the pool) empties the cache. A signature
is admitted after ``warmup`` calls of `admit` for it (the caller's eager steps before its capture).

The CUDA calls go through a backend object (`CudaBackend`); a test double with the same four methods runs the
cache's logic on the CPU.
"""
from __future__ import annotations

import contextlib
import gc
import warnings
from collections import Counter
from typing import Callable, Hashable, Mapping, Optional

import torch

from . import models

__all__ = ["CudaBackend", "GraphCache", "Graphs", "CachedGraphs", "clone", "copy_into", "side_stream", "signature"]


def signature(value):
    """The shapes, dtypes and devices of `value`'s tensors in its structure; other values by ``repr``."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, Mapping):
        return tuple(sorted((k, signature(v)) for k, v in value.items()))
    if isinstance(value, (tuple, list)):
        return tuple(signature(v) for v in value)
    return ("value", repr(value))


def clone(value):
    """`value` with every tensor replaced by a detached copy (dicts become dicts, tuples and lists keep their type)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: clone(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(clone(v) for v in value)
    return value


def copy_into(static, value):
    """Copies `value`'s tensors into those of `static` (same structure: `clone`'s output); other values stay."""
    if isinstance(static, torch.Tensor):
        static.copy_(value, non_blocking=True)
    elif isinstance(static, Mapping):
        for k in static:
            copy_into(static[k], value[k])
    elif isinstance(static, (tuple, list)):
        for s, v in zip(static, value):
            copy_into(s, v)


@contextlib.contextmanager
def side_stream(device):
    """Runs the block on a fresh side stream that waits for the current one, and the current one then for it (as
    PyTorch asks of the eager runs before a capture)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side):
            yield
    finally:
        torch.cuda.current_stream(device).wait_stream(side)


@contextlib.contextmanager
def _gc_paused():
    """No collection during a capture (one could free another graph's tensors mid-capture); none forced before it
    either: a full collection costs about 0.3 s in a training process, once per captured signature."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class CudaBackend:
    """How `GraphCache` captures on a GPU: `torch.cuda.CUDAGraph` through `models.graph_capture`."""

    @staticmethod
    def pool():
        return torch.cuda.graph_pool_handle()

    @staticmethod
    def capture(body, pool, generators):
        """``(graph, body's output)``: `body` captured into a new graph in `pool`, with `generators` registered."""
        graph = torch.cuda.CUDAGraph()
        for generator in generators:
            graph.register_generator_state(generator)
        with models.graph_capture(graph, pool):
            out = body()
        return graph, out

    @staticmethod
    def side_stream(device):
        return side_stream(device)

    @staticmethod
    def synchronize(device):
        torch.cuda.synchronize(device)


class Graphs:
    """The graphs of one signature: ``inputs`` (the static copies), ``graphs`` and ``outputs`` (each captured
    callable's return value, rewritten by its replays) by name, ``replays`` (a count per name) and ``extra`` (host
    values the user keeps with them)."""

    def __init__(self, inputs, graphs: dict, outputs: dict):
        self.inputs, self.graphs, self.outputs = inputs, graphs, outputs
        self.replays = Counter()
        self.extra = {}

    def load(self, inputs):
        """Copies `inputs` (the structure of the captured ones) into the static copies."""
        copy_into(self.inputs, inputs)

    def replay(self, name):
        self.graphs[name].replay()
        self.replays[name] += 1


class GraphCache:
    """CUDA graphs per input signature and key, up to ``max_graphs`` (module docstring)."""

    def __init__(self, max_graphs: int = 8, *, limit_warning: str, stacklevel: int = 0, backend=None):
        self.max_graphs = max_graphs
        self.limit_warning = limit_warning  # formatted with max_graphs
        self.stacklevel = stacklevel  # frames between the cache's caller and the user's code, for warnings
        self.backend = backend if backend is not None else CudaBackend()
        self.entries = {}  # signature -> Graphs, or None (its capture failed: runs eagerly)
        self._statics = {}  # input signature -> static copies
        self._seen = {}  # signature -> calls of `admit` before its capture (the caller's warm-up)
        self.pool = None
        self._warned = set()

    @property
    def max_graphs(self) -> int:
        return self._max_graphs

    @max_graphs.setter
    def max_graphs(self, value):
        if isinstance(value, bool) or int(value) != value or value < 0:
            raise ValueError(f"max_graphs: expected an integer >= 0, got {value!r}")
        self._max_graphs = int(value)

    @property
    def num_graphs(self) -> int:
        """Captured signatures (failed captures not counted)."""
        return sum(entry is not None for entry in self.entries.values())

    @staticmethod
    def signature(inputs, key: Hashable = ()):
        return signature(inputs), key

    def get(self, sig) -> Optional[Graphs]:
        """The graphs captured for `sig`, or None (not captured, or its capture failed)."""
        return self.entries.get(sig)

    def admit(self, sig, warmup: int = 0) -> bool:
        """Whether to capture `sig` now: not tried before, fewer than ``max_graphs`` signatures held (else one
        warning), and `warmup` earlier calls for it (this call counts as one when it says no)."""
        if sig in self.entries:
            return False
        if len(self.entries) >= self.max_graphs:
            self._warn("limit", self.limit_warning.format(max_graphs=self.max_graphs))
            return False
        seen = self._seen.get(sig, 0)
        if seen < warmup:
            self._seen[sig] = seen + 1
            return False
        return True

    def capture(self, sig, inputs, build: Callable[[object], dict], *, device, warmup: int = 0, generators=(),
                failed: Callable[[str], str]) -> Optional[Graphs]:
        """The `Graphs` of `sig`: `inputs` copied into its static copies, ``build(static)``'s callables warmed up
        `warmup` times each on a side stream and captured (no GPU work runs in the capture: replay them for these
        inputs). None where a capture raises: ``failed(reason)`` is the warning (once per error type) and the
        signature runs eagerly from then on."""
        static = self._statics.get(sig[0])
        if static is None:
            static = self._statics[sig[0]] = clone(inputs)
        copy_into(static, inputs)
        bodies = build(static)
        try:
            if self.pool is None:
                self.pool = self.backend.pool()
            if warmup:
                with self.backend.side_stream(device):
                    for _ in range(warmup):
                        for body in bodies.values():
                            body()
            graphs, outputs = {}, {}
            with _gc_paused():
                for name, body in bodies.items():
                    graphs[name], outputs[name] = self.backend.capture(body, self.pool, generators)
        except Exception as error:  # noqa: BLE001 - any capture failure means: run this signature eagerly
            self.backend.synchronize(device)
            text = str(error).splitlines()[0][:200] if str(error) else ""
            self._warn(("capture", type(error).__name__), failed(f"{type(error).__name__}: {text}"))
            self.entries[sig] = None
            return None
        entry = self.entries[sig] = Graphs(static, graphs, outputs)
        return entry

    def discard(self, sig) -> None:
        """Drops the graphs of `sig`, which from then on runs eagerly as after a failed capture (None, for
        ``entry = cache.discard(sig)``)."""
        self.entries[sig] = None

    def clear(self):
        """Drops every graph, static copy and warm-up count, and the memory pool (warnings given stay given)."""
        self.entries.clear()
        self._statics.clear()
        self._seen.clear()
        self.pool = None

    def _warn(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3 + self.stacklevel)


class CachedGraphs:
    """What a user of a `GraphCache` (held as ``cache``) shows of it: ``max_graphs`` (settable) and
    ``num_graphs`` (the captured signatures)."""

    @property
    def max_graphs(self) -> int:
        return self.cache.max_graphs

    @max_graphs.setter
    def max_graphs(self, value):
        self.cache.max_graphs = value

    @property
    def num_graphs(self) -> int:
        return self.cache.num_graphs
