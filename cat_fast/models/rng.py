"""Saving and restoring the random-number generators (CPU and the tensor's CUDA device) without a device sync:
how the counterfactual passes replay the clean forward's dropout masks."""
import contextlib

import torch

__all__ = ["get_state", "set_state", "PassGenerators"]


def get_state(device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_state(device, state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


class PassGenerators:
    """The clean forward's dropout redrawn by later passes inside one captured CUDA graph (a whole training step,
    `cat_fast.step.CapturedStep`), where `get_state` / `set_state` cannot run: they would read and set the host's
    offset once, at the capture, and every replay would redraw that step's masks.

    Each pass ``k`` draws from its own generator ``passes[k]``, switched in as the device's generator state
    (``graphsafe_set_state``) at the pass's marker (`Capture.rng_marker`: where `resume` would restore the clean
    forward's state); draws before the marker (discarded by the eager pass as well) go to ``scratch``. Before each
    replay (`before_replay`) every pass generator is set to the device generator's seed and to its offset at the
    replay's start plus ``lead``: the offset the clean forward had reached at the marker, measured on eager steps
    of the same step (`start` / `mark`). The generators are registered with the graph before its capture
    (`cat_fast.step.StepPlan.generators`)."""

    def __init__(self, device, passes: int):
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.default = torch.cuda.default_generators[index]
        self.scratch = torch.Generator(self.device)
        self.passes = [torch.Generator(self.device) for _ in range(passes)]
        self.lead = None  # offset increment from the step's start to the marker (eager steps)
        self._start = None
        self._original = None

    @property
    def generators(self) -> tuple:
        return (self.scratch, *self.passes)

    # ------------------------------------------------------------------ eager steps: measure the lead
    def start(self):
        """At the start of an eager step (before its clean forward draws anything)."""
        self._start = self.default.get_offset()

    def mark(self):
        """Where an eager pass has just restored the clean forward's state at the marker."""
        if self._start is not None:
            lead = self.default.get_offset() - self._start
            if self.lead is not None and lead != self.lead:
                raise RuntimeError(f"PassGenerators: the clean forward drew {lead} numbers before the marker, "
                                   f"{self.lead} on an earlier step of the same signature")
            self.lead = lead
            self._start = None

    # ------------------------------------------------------------------ captured steps
    def begin_pass(self, k: int):
        """Inside the capture, before pass ``k`` draws anything: its draws go to ``scratch`` until the marker."""
        self._original = self.default.graphsafe_get_state()
        self.default.graphsafe_set_state(self.scratch)
        self._pass = k

    def marker(self):
        self.default.graphsafe_set_state(self.passes[self._pass])

    def end_pass(self):
        self.default.graphsafe_set_state(self._original)
        self._original = None

    @contextlib.contextmanager
    def pass_(self, k: int, cap):
        """Inside the capture: pass ``k`` (a `resume` or `head_logits` call on `cap`) draws from its own generator
        from the marker on."""
        self.begin_pass(k)
        cap.rng_marker = self.marker
        try:
            yield
        finally:
            cap.rng_marker = None
            self.end_pass()

    def before_replay(self):
        if self.lead is None:
            raise RuntimeError("PassGenerators: no eager step measured the clean forward's draws before the marker")
        seed, offset = self.default.initial_seed(), self.default.get_offset() + self.lead
        for g in self.passes:
            if g.initial_seed() != seed:  # the first replay, or the device generator reseeded since
                g.manual_seed(seed)
            g.set_offset(offset)
