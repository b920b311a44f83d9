"""CUDA-graph replay of CAT's CAL steps and final counterfactual pass (static shapes), used by `CAT` on a GPU.

`CALGraphs` captures one CAL step (`CAT.cal_ascent`, the function the eager loop runs: cmix → layers m+1..L → J →
∂J/∂λ → `cal_step_`) and the final counterfactual forward as two CUDA graphs per batch signature (shapes, dtypes,
mixing layer, mode, autocast, hyper-parameters) in a `cat_fast.graphs.GraphCache`, and replays the first
``adv_steps`` times; what changes between steps enters through the cache's static copies. Replays set the CUDA
generator to the clean forward's state at layer m+1, so they draw its dropout masks; under autocast they cast the
current weights (cache off); replaced parameters drop every graph. New signatures are captured up to
``max_graphs``; others, and any whose capture fails, run eagerly with the same results. Pad to a few lengths.
"""
from __future__ import annotations

import torch

from .. import models
from ..graphs import CachedGraphs, GraphCache, clone

__all__ = ["CALGraphs"]

# Bumped by torch.nn's global registration hooks whenever any module sets a parameter, buffer or submodule: the
# cheap test of whether a model's tensor list may have changed (walking `model.parameters()` every step costs host
# time right where the GPU waits for the graph replays).
_registrations = [0]
_watching = []


def _count_registration(*_args):
    _registrations[0] += 1


def _watch_registrations():
    if not _watching:
        from torch.nn.modules import module as nn_module

        _watching.extend((nn_module.register_module_parameter_registration_hook(_count_registration),
                          nn_module.register_module_buffer_registration_hook(_count_registration),
                          nn_module.register_module_module_registration_hook(_count_registration)))


def _generator(device):
    return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]


def _measured(body, static_cap, gen, leads, name):
    """`body`, which outside a capture (the warm-up) also records in ``leads[name]`` the random numbers its pass
    draws before layer m+1 (e.g. DeBERTa's conv dropout on the placeholders), which the eager resume discards by
    restoring the RNG at layer m+1: replays start that much earlier."""

    def run():
        if torch.cuda.is_current_stream_capturing():
            return body()
        marks = []
        static_cap.rng_marker = lambda offset=None: marks.append(gen.get_offset())
        start = gen.get_offset()
        try:
            out = body()
        finally:
            static_cap.rng_marker = None
        leads[name] = marks[0] - start if marks else 0
        return out

    return run


class CALGraphs(CachedGraphs):  # num_graphs: signatures, each a CAL-step and a final-forward graph
    """Captures and replays CAT's CAL steps + final counterfactual forward per static signature."""

    def __init__(self, cat, max_graphs: int = 8):
        self.cat = cat
        # per signature two graphs, "cal" and "final" (`cat_fast.graphs`)
        self.cache = GraphCache(max_graphs, stacklevel=1, limit_warning=(
            "cat_fast CAT: more than max_graphs={max_graphs} batch signatures (shapes, layers); new ones run "
            "eagerly. Pad sequences to a few fixed lengths."))
        self._zeros = {}  # (shape, dtype, device) -> the zero placeholder of a layer output the graphs do not read
        self._weights_seen = None
        self._tensors = None  # the model's parameters and buffers, listed when _registrations was _tensors_at
        self._tensors_at = None
        self.replays_in_forward = 0  # steps whose CAL graphs ran from inside the clean forward (`run_captured`)

    def _weights(self):
        """Addresses of the model's parameters and buffers: graphs read these addresses, so a replaced tensor
        (a new head module, ``p.data = ...``, ``model.to(...)``) invalidates every graph."""
        _watch_registrations()
        if self._tensors is None or self._tensors_at != _registrations[0]:
            model = self.cat.model
            self._tensors = list(model.parameters()) + list(model.buffers())
            self._tensors_at = _registrations[0]
        return tuple(t.data_ptr() for t in self._tensors)

    @staticmethod
    def usable(h) -> bool:
        return (h.is_cuda and not torch.cuda.is_current_stream_capturing()
                and not torch.compiler.is_compiling())

    @staticmethod
    def _inputs(cap, h, lam, partner, targets, allow):
        return {"h": h, "lam": lam, "partner": partner, "targets": targets, "allow": allow, "inputs": cap.inputs,
                "padding_mask": cap.padding_mask}

    def _signature(self, cap, inputs):
        cat = self.cat
        autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        key = (cap.layer, cap.hidden_loc, cat.model.training, autocast, cat.adv_lr, cat.p, cat.gamma, cat.eta,
               cat.mask_mode, cat.first_token(cap))
        return self.cache.signature(inputs, key)

    def run(self, cap, h, lam, partner, targets, allow):
        """``(λ after adv_steps CAL steps, counterfactual logits)``, or None when this signature runs eagerly.

        `h` is ``h_m`` detached, `lam` the initial λ (not modified)."""
        weights = self._weights()
        if weights != self._weights_seen:  # parameters replaced (not updated in place): graphs would read old ones
            self.cache.clear()
            self._zeros.clear()
            self._weights_seen = weights
        inputs = self._inputs(cap, h, lam, partner, targets, allow)
        sig = self._signature(cap, inputs)
        entry = self.cache.get(sig)
        if entry is None and self.cache.admit(sig):
            entry = self._capture(sig, cap, inputs)
        if entry is None:
            return None
        return self._replay(entry, cap, inputs)

    def run_captured(self, cap, h, lam, partner, targets, allow):
        """`run` for a signature whose graphs exist already; None (nothing captured or run) otherwise. For a call
        from inside the clean forward (`models.capture(on_hidden=...)`), where a capture must not happen."""
        if self._weights() != self._weights_seen:
            return None
        inputs = self._inputs(cap, h, lam, partner, targets, allow)
        entry = self.cache.get(self._signature(cap, inputs))
        if entry is None:
            return None
        out = self._replay(entry, cap, inputs)
        self.replays_in_forward += out is not None
        return out

    # ------------------------------------------------------------------ capture
    def _placeholder(self, out):
        """`out` (a layer's output: tensor or tuple) with every tensor replaced by a shared zero buffer."""
        if isinstance(out, torch.Tensor):
            key = (tuple(out.shape), out.dtype, out.device)
            if key not in self._zeros:
                self._zeros[key] = torch.zeros(out.shape, dtype=out.dtype, device=out.device)
            return self._zeros[key]
        if isinstance(out, (tuple, list)):
            return type(out)(self._placeholder(t) for t in out)
        return out

    def _capture(self, sig, cap, inputs):
        cat = self.cat
        device = inputs["h"].device
        gen = _generator(device)
        enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        leads = {}

        def build(s):
            static_cap = models.Capture(
                layer=cap.layer, hidden=s["h"], outputs=None, inputs=s["inputs"], training=cap.training,
                layer_outputs=[self._placeholder(o) for o in cap.layer_outputs], hidden_loc=cap.hidden_loc,
                embedding_output=self._placeholder(cap.embedding_output), rng_state=None,
                last_output=self._placeholder(cap.last_output), padding_mask=s["padding_mask"])
            args = (static_cap, s["h"], s["lam"], s["partner"], s["padding_mask"], s["allow"])

            def cal():  # the eager loop's CAL step, under the graph's autocast (weight cache off)
                cat.cal_ascent(*args, s["targets"],
                               within=torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False))

            def final():
                with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False):
                    return cat.counterfactual_logits(*args)

            return {"cal": _measured(cal, static_cap, gen, leads, "cal"),
                    "final": _measured(final, static_cap, gen, leads, "final")}

        def failed(reason):
            return (f"cat_fast CAT: CUDA-graph capture of the CAL loop failed for {cat.structure.model_class} "
                    f"({reason}); this batch signature runs eagerly (same results). Pass CAT(..., cuda_graph=False) "
                    "to silence this.")

        saved_rng = models.get_rng_state(device)  # the warm-up draws: put back
        try:
            entry = self.cache.capture(sig, inputs, build, device=device, warmup=1, failed=failed)
        finally:
            models.set_rng_state(device, saved_rng)
        if entry is not None:
            entry.extra["leads"] = leads  # RNG offset drawn before layer m+1 in each graph
        return entry

    # ------------------------------------------------------------------ replay
    def _replay(self, entry, cap, inputs):
        device = inputs["h"].device
        leads = entry.extra["leads"]
        same_dropout = self.cat.model.training and cap.rng_state is not None
        if same_dropout:
            gen = _generator(device)
            saved_rng = models.get_rng_state(device)
            models.set_rng_state(device, cap.rng_state)
            start = gen.get_offset()
            if start < max(leads.values()):  # cannot start early enough: run eagerly
                models.set_rng_state(device, saved_rng)
                return None
        entry.load(inputs)
        try:
            for _ in range(self.cat.adv_steps):
                if same_dropout:
                    gen.set_offset(start - leads["cal"])
                entry.replay("cal")
            if same_dropout:
                gen.set_offset(start - leads["final"])
            entry.replay("final")
        finally:
            if same_dropout:
                models.set_rng_state(device, saved_rng)
        return entry.inputs["lam"].clone(), clone(entry.outputs["final"])
