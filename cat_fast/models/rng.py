"""Saving and restoring the random-number generators (CPU and the tensor's CUDA device) without a device sync:
how the counterfactual passes replay the clean forward's dropout masks."""
import contextlib

import torch

from ..layers import packing
from ..ops.fused import rng_offset

__all__ = ["get_state", "set_state", "graph_offset", "PassGenerators"]


def get_state(device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_state(device, state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def graph_offset(device):
    """`ops.fused.rng_offset` of `device`'s default CUDA generator (inside a CUDA-graph capture, the offset within
    the graph), or None off CUDA or without the extension's op."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return rng_offset(torch.cuda.default_generators[index])


class PassGenerators:
    """The clean forward's dropout redrawn by later passes inside one captured CUDA graph (a whole training step,
    `cat_fast.step.CapturedStep`), where `get_state` / `set_state` cannot run: they would read and set the host's
    offset once, at the capture, and every replay would redraw that step's masks.

    Each pass ``k`` draws from its own generator ``passes[k]``, switched in as the device's generator state
    (``graphsafe_set_state``) at the pass's marker (`Capture.rng_marker`: where `resume` would restore the clean
    forward's state); draws before the marker (discarded by the eager pass as well) go to ``scratch``. Before each
    replay (`before_replay`) every pass generator is set to the device generator's seed and to its offset at the
    replay's start plus ``lead``: the offset the clean forward had reached at the marker, one lead per packed row
    count (`layers.packing.static_count`, under which a captured step runs a packed signature's eager steps, its
    capture and its replays: packed layers draw over their rows). The capture measures it (`start`, and the offset
    `models.capture` records where the clean forward reaches the marker, read by `ops.fused.rng_offset`: the offset
    within the graph); eager steps of the same rows measure it too (`start` / `mark`), and the two must agree. The
    generators are registered with the graph before its capture (`cat_fast.step.StepPlan.generators`). `for_batch`
    gives an objective's instance for a batch's shapes."""

    def __init__(self, device, passes: int):
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.default = torch.cuda.default_generators[index]
        self.scratch = torch.Generator(torch.device("cuda", index))
        self.passes = [torch.Generator(torch.device("cuda", index)) for _ in range(passes)]
        self.leads = {}  # packed row count (or None) -> offset increment from the step's start to the marker
        self._start = None  # the device generator's offset at an eager step's start
        self._graph_start = None  # its offset within the graph at a capture's start (None: not read)

    @staticmethod
    def for_batch(cache: dict, batch, device, passes: int, *key):
        """The instance in `cache` for the shapes of `batch`'s model inputs and `key` (one per graph an objective
        captures), made on first use."""
        from .inputs import model_inputs

        sig = key + tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(model_inputs(batch).items())
                          if isinstance(v, torch.Tensor))
        if sig not in cache:
            cache[sig] = PassGenerators(device, passes)
        return cache[sig]

    @property
    def generators(self) -> tuple:
        return (self.scratch, *self.passes)

    def plan_fields(self) -> dict:
        """``generators`` and ``before_replay`` of a `cat_fast.step.StepPlan` whose passes draw from these."""
        return {"generators": self.generators, "before_replay": self.before_replay}

    # ------------------------------------------------------------------ measure the lead
    def start(self):
        """At the start of a step, eager or inside its capture (before its clean forward draws anything)."""
        if torch.cuda.is_current_stream_capturing():
            self._graph_start = rng_offset(self.default)  # None without the extension's op: eager steps measure
        else:
            self._start = self.default.get_offset()

    def mark(self, offset=None):
        """Where an eager pass has just restored the clean forward's state at the marker (`offset`, what a capture
        records there, is not used: the restored state's offset is the clean forward's)."""
        if self._start is not None:
            self._record(self.default.get_offset() - self._start)
            self._start = None

    def _record(self, lead):
        rows = packing.static_count()
        known = self.leads.get(rows)
        if known is not None and lead != known:
            raise RuntimeError(f"PassGenerators: the clean forward drew {lead} numbers before the marker, "
                               f"{known} on an earlier step of the same signature")
        self.leads[rows] = lead

    # ------------------------------------------------------------------ captured steps
    @contextlib.contextmanager
    def pass_(self, k: int, cap):
        """Inside the capture: pass ``k`` (a `resume` or `head_logits` call on `cap`) draws from ``scratch`` until
        its marker, then from its own generator. At the marker, the offset within the graph that the clean forward
        had reached there (recorded by `models.capture`) less the capture's start is this row count's lead."""
        original = self.default.graphsafe_get_state()
        self.default.graphsafe_set_state(self.scratch)

        def marker(offset=None):
            if offset is not None and self._graph_start is not None:
                self._record(offset - self._graph_start)
            self.default.graphsafe_set_state(self.passes[k])

        cap.rng_marker = marker
        try:
            yield
        finally:
            cap.rng_marker = None
            self.default.graphsafe_set_state(original)

    def before_replay(self):
        """Before a replay of the graph of the packed row count in force (`layers.packing.static_rows`)."""
        lead = self.leads.get(packing.static_count())
        if lead is None:
            raise RuntimeError("PassGenerators: neither an eager step nor the capture measured the clean forward's draws "
                               "before the marker")
        seed, offset = self.default.initial_seed(), self.default.get_offset() + lead
        for g in self.passes:
            if g.initial_seed() != seed:  # the first replay, or the device generator reseeded since
                g.manual_seed(seed)
            g.set_offset(offset)
