"""The optimizer's step during the backward: each group of parameters stepped as soon as the backward has finished
their gradients (`cat_fast.step.CapturedStep` with ``OVERLAP_UPDATE``).

``updates = BackwardUpdates(optimizer, params, groups=8)``, then ``with updates.during(): loss.backward()`` and
``updates.finish()``: inside, each parameter's post-accumulate-grad hook marks its gradient final; once the final
ones not yet stepped hold a ``1/groups`` share of the parameters' elements, the optimizer steps them (the other
parameters' ``.grad`` hidden for that call, as `CapturedStep._update` does under DDP). On CUDA that step runs on a
stream of its own, after the work the backward has queued so far, beside the rest of the backward: the update's
memory-bound kernels fill the backward's gaps instead of following it. ``finish`` makes the current stream wait for
that stream and steps the parameters left (those finished last, the embeddings in a Bert-layout model, and any
without a gradient: skipped by the optimizer as in a plain step). Elsewhere each group steps inline.

For an optimizer whose update is per parameter (PyTorch's `_PER_PARAMETER` ones, `step._splittable`) and no
clipping (which needs every gradient first), this is the plain step, bit for bit: each parameter is stepped once,
with its final gradient, by the same kernels. A parameter is stepped only after every node of the backward that
reads it has run (its gradient is final only then), so the in-place update changes nothing the backward reads;
autograd's version counters would raise where a node saved one and ran later.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

__all__ = ["BackwardUpdates", "step_alone"]


def step_alone(optimizer, params, group):
    """`optimizer`'s step of the parameters of `group` alone: the gradients of the other `params` hidden (None)
    for the call, then put back. For a per-parameter optimizer, the part of its whole step that updates `group`."""
    ids = {id(p) for p in group}
    hidden = [(p, p.grad) for p in params if id(p) not in ids and p.grad is not None]
    for p, _ in hidden:
        p.grad = None
    try:
        optimizer.step()
    finally:
        for p, grad in hidden:
            p.grad = grad


def _remove(handles):
    for handle in handles:
        handle.remove()


class BackwardUpdates:
    """The step of `optimizer` over `params`, in `groups` shares run during the backward (module docstring)."""

    def __init__(self, optimizer, params, groups: int = 8):
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"BackwardUpdates: groups must be an integer >= 1, got {groups!r}")
        self.optimizer = optimizer
        self.groups = groups
        unique = {id(p): p for p in params if p.requires_grad}
        self.params = list(unique.values())
        total = sum(p.numel() for p in self.params)
        self.share = max(1, -(-total // groups))  # elements a group gathers before it steps
        self.launched = 0  # groups the last backward stepped before it ended
        self._open = None  # during a backward: its state
        self._streams = {}  # device -> the stream the groups step on
        self._handles = []

    def _hook(self):
        ref = weakref.ref(self)

        def hook(p):
            updates = ref()
            if updates is not None and updates._open is not None and updates._open["within"]:
                updates._final(p)

        self._handles = [p.register_post_accumulate_grad_hook(hook) for p in self.params]
        weakref.finalize(self, _remove, self._handles)  # the parameters outlive this object: no idle hooks

    @contextlib.contextmanager
    def during(self):
        """Within (one backward): the groups step as their gradients are final (module docstring)."""
        if not self._handles:
            self._hook()
        self._open = {"ready": [], "elements": 0, "stepped": set(), "devices": set(), "kept": [], "within": True}
        self.launched = 0
        try:
            yield
        except BaseException:
            self._join()
            self._open = None
            raise
        self._open["within"] = False

    def _final(self, p):
        state = self._open
        if id(p) in state["stepped"]:  # a second accumulation in one backward: this class does not apply
            raise RuntimeError("BackwardUpdates: a parameter's gradient was accumulated again after its group "
                               "stepped (a backward that accumulates a parameter twice); run without "
                               "OVERLAP_UPDATE")
        state["ready"].append(p)
        state["elements"] += p.numel()
        if state["elements"] >= self.share:
            group, state["ready"], state["elements"] = state["ready"], [], 0
            self._step(group, state)
            self.launched += 1

    def _step(self, group, state):
        """The optimizer's step of `group` alone; on CUDA on the update stream, after the work queued so far on the
        current stream (the gradients), the gradients kept until the current stream waits for it (`finish`)."""
        state["stepped"].update(id(p) for p in group)
        device = group[0].device
        if device.type != "cuda":
            self._step_alone(group)
            return
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the backward's stream here: the gradients made
        state["devices"].add(device)
        state["kept"].extend(p.grad for p in group)
        with torch.cuda.stream(stream):
            self._step_alone(group)

    def _step_alone(self, group):
        step_alone(self.optimizer, self.params, group)

    def _join(self):
        """The current stream waits for the update stream of every device a group stepped on; the gradients kept
        for those steps may go."""
        state = self._open
        if state is None:
            return
        for device in state["devices"]:
            torch.cuda.current_stream(device).wait_stream(self._streams[device])
        state["devices"].clear()
        state["kept"].clear()

    def finish(self):
        """After the backward: the current stream waits for the groups' steps, and the parameters not yet stepped
        step now, on the current stream."""
        state = self._open
        if state is None:
            raise RuntimeError("BackwardUpdates.finish: no backward ran within during()")
        try:
            self._join()
            rest = [p for p in self.params if id(p) not in state["stepped"]]
            if rest:
                self._step_alone(rest)
        finally:
            self._open = None
