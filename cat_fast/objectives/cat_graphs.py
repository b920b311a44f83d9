"""CUDA-graph replay of CAT's CAL steps and final counterfactual pass (static shapes), used by `CAT` on a GPU.

`CALGraphs` captures one CAL step (cmix → layers m+1..L → J → ∂J/∂λ → `cal_step_`) and the final counterfactual
forward as two CUDA graphs per batch signature (shapes, dtypes, mixing layer, mode, autocast, hyper-parameters)
and replays the first ``adv_steps`` times; what changes between steps enters through static buffers. Replays set
the CUDA generator to the clean forward's state at layer m+1, so they draw its dropout masks; under autocast they
cast the current weights (cache off); replaced parameters drop every graph. New signatures are captured up to
``max_graphs``; others, and any whose capture fails, run eagerly with the same results. Pad to a few lengths.
"""
from __future__ import annotations

import gc
import warnings

import torch

from .. import models

__all__ = ["CALGraphs"]


def _tensor_sig(x):
    if x is None:
        return None
    if isinstance(x, (tuple, list)):
        return tuple(_tensor_sig(t) for t in x)
    return (tuple(x.shape), x.dtype, x.device)


def _inputs_sig(inputs):
    return tuple(sorted((k, _tensor_sig(v) if isinstance(v, torch.Tensor) else ("value", repr(v)))
                        for k, v in inputs.items()))


def _clone(x):
    if x is None:
        return None
    if isinstance(x, (tuple, list)):
        return tuple(_clone(t) for t in x)
    return x.detach().clone()


def _copy_into(static, value):
    if static is None:
        return
    if isinstance(static, tuple):
        for s, v in zip(static, value):
            s.copy_(v, non_blocking=True)
    else:
        static.copy_(value, non_blocking=True)


# Bumped by torch.nn's global registration hooks whenever any module sets a parameter, buffer or submodule: the
# cheap test of whether a model's tensor list may have changed (walking `model.parameters()` costs ~0.5 ms of
# host time per step for BERT-base, right where the GPU waits for the graph replays).
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


class _Statics:
    """Static buffers shared by the graphs of one batch signature (all mixing layers)."""

    def __init__(self, cap, h, lam, partner, targets, allow):
        self.h = h.detach().clone()
        self.lam = lam.detach().clone()
        self.partner = partner.clone()
        self.targets = _clone(targets)
        self.allow = _clone(allow)
        self.inputs = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in cap.inputs.items()}
        self.padding_mask = _clone(cap.padding_mask)
        self._zeros = {}

    def placeholder(self, out):
        """`out` (a layer's output: tensor or tuple) with every tensor replaced by a shared zero buffer."""
        if isinstance(out, torch.Tensor):
            key = (tuple(out.shape), out.dtype, out.device)
            if key not in self._zeros:
                self._zeros[key] = torch.zeros(out.shape, dtype=out.dtype, device=out.device)
            return self._zeros[key]
        if isinstance(out, (tuple, list)):
            return type(out)(self.placeholder(t) for t in out)
        return out

    def load(self, cap, h, lam, partner, targets, allow):
        self.h.copy_(h, non_blocking=True)
        self.lam.copy_(lam, non_blocking=True)
        self.partner.copy_(partner, non_blocking=True)
        _copy_into(self.targets, targets)
        _copy_into(self.allow, allow)
        _copy_into(self.padding_mask, cap.padding_mask)
        for k, v in cap.inputs.items():
            if isinstance(v, torch.Tensor):
                self.inputs[k].copy_(v, non_blocking=True)


class _Graphs:
    def __init__(self, statics, cal, final, cf_out, leads):
        self.statics = statics
        self.cal = cal
        self.final = final
        self.cf_out = cf_out  # static output of the final graph (logits, or a tuple for QA)
        self.cal_lead, self.final_lead = leads  # RNG offset drawn before layer m+1 in each graph


class CALGraphs:
    """Captures and replays CAT's CAL steps + final counterfactual forward per static signature."""

    def __init__(self, cat, max_graphs: int = 8):
        self.cat = cat
        self.max_graphs = int(max_graphs)
        self._graphs = {}  # signature -> _Graphs, or None when its capture failed
        self._statics = {}  # signature without the layer -> _Statics
        self._pool = None
        self._warned = set()
        self._weights_seen = None
        self._tensors = None  # the model's parameters and buffers, listed when _registrations was _tensors_at
        self._tensors_at = None
        self.replays_in_forward = 0  # steps whose CAL graphs ran from inside the clean forward (`run_captured`)

    @property
    def num_graphs(self) -> int:
        """Number of captured signatures (each: one CAL-step graph and one final-forward graph)."""
        return sum(1 for g in self._graphs.values() if g is not None)

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

    def _signature(self, cap, h, lam, partner, targets, allow):
        cat = self.cat
        autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        base = (_tensor_sig(h), _tensor_sig(lam), _tensor_sig(partner), _tensor_sig(targets), _tensor_sig(allow),
                _inputs_sig(cap.inputs), _tensor_sig(cap.padding_mask), cap.hidden_loc, self.cat.model.training,
                autocast)
        hyper = (cat.adv_lr, cat.p, cat.gamma, cat.eta, cat.mask_mode, cat.first_token(cap))
        return base, (cap.layer,) + base + hyper

    def run(self, cap, h, lam, partner, targets, allow):
        """``(λ after adv_steps CAL steps, counterfactual logits)``, or None when this signature runs eagerly.

        `h` is ``h_m`` detached, `lam` the initial λ (not modified)."""
        weights = self._weights()
        if weights != self._weights_seen:  # parameters replaced (not updated in place): graphs would read old ones
            self._graphs.clear()
            self._statics.clear()
            self._pool = None
            self._weights_seen = weights
        base, sig = self._signature(cap, h, lam, partner, targets, allow)
        graphs = self._graphs.get(sig, False)
        if graphs is False:
            if len(self._graphs) >= self.max_graphs:
                self._warn("limit", f"cat_fast CAT: more than max_graphs={self.max_graphs} batch signatures (shapes, "
                                    "layers); new ones run eagerly. Pad sequences to a few fixed lengths.")
                return None
            graphs = self._graphs[sig] = self._capture(base, cap, h, lam, partner, targets, allow)
        if graphs is None:
            return None
        return self._replay(graphs, cap, h, lam, partner, targets, allow)

    def run_captured(self, cap, h, lam, partner, targets, allow):
        """`run` for a signature whose graphs exist already; None (nothing captured or run) otherwise. For a call
        from inside the clean forward (`models.capture(on_hidden=...)`), where a capture must not happen."""
        if self._weights() != self._weights_seen:
            return None
        graphs = self._graphs.get(self._signature(cap, h, lam, partner, targets, allow)[1])
        if graphs is None:
            return None
        out = self._replay(graphs, cap, h, lam, partner, targets, allow)
        self.replays_in_forward += out is not None
        return out

    # ------------------------------------------------------------------ capture
    def _capture(self, base, cap, h, lam, partner, targets, allow):
        statics = self._statics.get(base)
        if statics is None:
            statics = self._statics[base] = _Statics(cap, h, lam, partner, targets, allow)
        statics.load(cap, h, lam, partner, targets, allow)
        static_cap = models.Capture(
            layer=cap.layer, hidden=statics.h, outputs=None, inputs=statics.inputs, training=cap.training,
            layer_outputs=[statics.placeholder(o) for o in cap.layer_outputs], hidden_loc=cap.hidden_loc,
            embedding_output=statics.placeholder(cap.embedding_output), rng_state=None,
            last_output=statics.placeholder(cap.last_output), padding_mask=statics.padding_mask)
        cat = self.cat
        mask = statics.padding_mask
        enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        cf_box = []

        def cal_step():
            with torch.enable_grad(), torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False):
                lam_var = statics.lam.detach().requires_grad_(True)
                cf_logits = cat.counterfactual_logits(static_cap, statics.h, lam_var, statics.partner, mask, statics.allow)
                objective = cat.cal_objective_per_sample(cf_logits, statics.targets).sum()
                (grad,) = torch.autograd.grad(objective, lam_var)
            cat.cal_step(statics.lam, grad)

        def final_forward():
            with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False):
                cf_box.append(cat.counterfactual_logits(static_cap, statics.h, statics.lam, statics.partner, mask, statics.allow))

        device = h.device
        gen = _generator(device)
        saved_rng = models.get_rng_state(device)
        marks = []
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            # Warm-up outside capture (lazy initialisations, cuBLAS workspaces); it also measures the random
            # numbers a pass draws before layer m+1 (e.g. DeBERTa's conv dropout on the placeholders), which
            # the eager resume discards by restoring the RNG at layer m+1: replays start that much earlier.
            static_cap.rng_marker = lambda: marks.append(gen.get_offset())
            leads = []
            with torch.cuda.stream(side):
                for body in (cal_step, final_forward):
                    start = gen.get_offset()
                    marks.clear()
                    body()
                    leads.append(marks[0] - start if marks else 0)
            static_cap.rng_marker = None
            torch.cuda.current_stream(device).wait_stream(side)
            cf_box.clear()
            # No garbage collection during capture: a collection there can free another CAT's graphs (CAT and its
            # CALGraphs form a reference cycle), and destroying a graph while one is being captured leaves the CUDA
            # generator in capture state ("Offset increment outside graph capture") or fails the capture.
            gc_was_enabled = gc.isenabled()
            gc.collect()
            gc.disable()
            try:
                cal = torch.cuda.CUDAGraph()
                with models.graph_capture(cal, self._pool):
                    cal_step()
                final = torch.cuda.CUDAGraph()
                with models.graph_capture(final, self._pool):
                    final_forward()
            finally:
                if gc_was_enabled:
                    gc.enable()
            return _Graphs(statics, cal, final, cf_box[-1], leads)
        except Exception as error:  # noqa: BLE001 - any capture failure means: run this signature eagerly
            self._warn(("capture", type(error).__name__),
                       f"cat_fast CAT: CUDA-graph capture of the CAL loop failed for {cat.structure.model_class} "
                       f"({type(error).__name__}: {str(error).splitlines()[0][:200]}); this batch signature runs "
                       "eagerly (same results). Pass CAT(..., cuda_graph=False) to silence this.")
            torch.cuda.synchronize(device)
            return None
        finally:
            models.set_rng_state(device, saved_rng)

    # ------------------------------------------------------------------ replay
    def _replay(self, graphs, cap, h, lam, partner, targets, allow):
        device = h.device
        same_dropout = self.cat.model.training and cap.rng_state is not None
        if same_dropout:
            gen = _generator(device)
            saved_rng = models.get_rng_state(device)
            models.set_rng_state(device, cap.rng_state)
            start = gen.get_offset()
            if start < max(graphs.cal_lead, graphs.final_lead):  # cannot start early enough: run eagerly
                models.set_rng_state(device, saved_rng)
                return None
        statics = graphs.statics
        statics.load(cap, h, lam, partner, targets, allow)
        try:
            for _ in range(self.cat.adv_steps):
                if same_dropout:
                    gen.set_offset(start - graphs.cal_lead)
                graphs.cal.replay()
            if same_dropout:
                gen.set_offset(start - graphs.final_lead)
            graphs.final.replay()
        finally:
            if same_dropout:
                models.set_rng_state(device, saved_rng)
        return statics.lam.clone(), _clone(graphs.cf_out)

    def _warn(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=4)
