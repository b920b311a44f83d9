"""Causal logit perturbation (CLP, Zhou et al. 2025; docs/METHODS.md §5): a perturbation network Ω maps ten
training characteristics of each example to a perturbation δ of its TRUE-class logit, and is meta-learned so that a
virtual step of the classifier on the perturbed loss lowers the loss on a small balanced metadata set.

    objective = CLP(model, meta_batches)              # meta_batches: model inputs + labels, cycled
    loss, info = objective(batch)                      # one step: Ω's meta update inside, the classifier's loss out

Each call:
1. the forward of the training batch, the head's input captured (``features``), and the characteristics
   ``ops.sample_characteristics(logits, labels, features, W_head, class_stats)`` (detached: Ω reads them, nothing
   flows back through them);
2. the meta step: δ = Ω(characteristics), a virtual SGD step of the classifier on ``CE(z + δ·e_y, y)`` with
   ``create_graph`` — of the head only (``virtual="head"``, the default) or of every trainable parameter
   (``virtual="all"``, with `torch.func.functional_call`) — then the cross-entropy of the virtually-updated
   classifier on the next metadata batch, whose gradient w.r.t. Ω is one Adam step (lr 1e-3, weight decay 1e-4);
3. the real loss ``CE(z + δ'·e_y, y)`` with δ' = Ω(characteristics) from the updated Ω, detached: the trainer
   back-propagates it into the classifier and steps its own optimizer.

Why the head by default: with the backbone frozen for the virtual step, the step needs no second pass through the
encoder (the features of both batches are reused, the metadata batch runs forward only, without a graph) and no
double backward through attention, so a CLP step costs about one ERM step plus one forward; the head is also where a
logit perturbation acts first. ``virtual="all"`` is the paper's full bi-level step: a double backward through the
whole model (it needs a model whose attention supports it: eager attention for BERT-style models).

δ goes to the true-class logit only. A perturbation added to every logit would not change the softmax, so the
classifier would train on plain cross-entropy and Ω would get a zero gradient (the authors' released code does that).

Class statistics (prior, mean loss, mean margin per class) live on the device; the loss and margin of each batch are
accumulated without a host synchronisation and become "the last epoch's" when ``epoch_size`` examples have been
seen (before the first epoch ends, the running means of the epoch so far stand in). ``class_prior`` fixes the prior
(e.g. the training set's class frequencies); otherwise the running class counts give it.

Diagnostics (`clp_diagnostics.CLPDiagnostics`, read by ``epoch_record()``: the CLI's metrics.json history keeps one
``clp_diagnostics`` per epoch): δ' per class and per (class, group) when the batch has a ``diagnostic_group``
column (``group_names=`` names the ids; the CLI's ``--diagnose-column``), the meta-gradient's norm, the metadata loss
before and after the virtual step, the virtual step's norm; accumulated on the device without a host sync.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import data, models, ops
from ..ops.fused import upcast
from ..step import NotCapturable, StepPlan
from .base import Objective, check_number
from .clp_diagnostics import CLPDiagnostics, grad_norm
from .clp_net import PerturbationNet, find_head
from .config import DIAGNOSTIC_GROUPS, METADATA, Curve, ObjectiveConfig, option

__all__ = ["CLP", "CLPConfig", "PerturbationNet", "find_head", "metadata_from_cad"]

metadata_from_cad = data.metadata_from_cad  # CLP's metadata from CAD dev (`cat_fast.data`)

_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass
class CLPConfig(ObjectiveConfig):
    """CLP's options (docs/METHODS.md §5; `CLP.from_options`); the defaults are the paper's (Adam lr 1e-3 on Ω, the
    bound 1 of its tanh). What each one does to a planted shortcut, with the per-epoch diagnostics, is in
    docs/RESULTS-clp.md: the bound limits how far δ can reweight an example (at most about e^(2·clp_scale)
    between δ = -bound and +bound); `virtual_lr` scales Ω's meta-gradient, which Ω's Adam then normalises, so it
    changes Ω's updates only through second-order terms."""

    title = "CLP"
    meta_lr: float = option(1e-3, low=0.0, low_open=True, help="Adam learning rate of the perturbation network")
    clp_scale: float = option(1.0, low=0.0, low_open=True, help="the perturbation's bound (tanh times this)")
    virtual_lr: Optional[float] = option(None, type=float, low=0.0, low_open=True, help="step size of the virtual "
                                         "SGD step (default: the optimizer's current learning rate, which for AdamW "
                                         "is a much smaller step than the real one)")


class CLP(Objective):
    """Causal logit perturbation (module docstring). `model`: a Hugging Face sequence classifier (batches of
    tokenised inputs) or any ``nn.Module`` called as ``model(batch["inputs"])`` that ends in a Linear head."""

    config = CLPConfig
    # `meta_batches` (the CLI's: --meta-data, or a balanced draw from CAD dev); a group per example for the
    # diagnostics when the batch has one
    requires = (METADATA, DIAGNOSTIC_GROUPS)
    curves = (Curve("meta_loss", "meta loss", "metadata", after_warmup=True),
              Curve("delta_abs_mean", "mean |perturbation|", "metadata", after_warmup=True),
              Curve("meta_grad_norm", "|meta-gradient of Ω|", "meta step", after_warmup=True),
              Curve("virtual_step", "|virtual step|", "meta step", after_warmup=True),
              Curve("meta_loss_change", "meta loss after - before the virtual step", "meta step",
                    after_warmup=True))

    @classmethod
    def from_options(cls, model, options, **preset):
        """From the CLI: ``clp_scale``, ``meta_lr``, ``virtual_lr``."""
        for key, name in (("clp_scale", "scale"), ("meta_lr", "meta_lr"), ("virtual_lr", "virtual_lr")):
            if options.get(key) is not None:
                preset.setdefault(name, options[key])
        return cls(model, **preset)

    def __init__(self, model, meta_batches: Iterable[dict], virtual: str = "head", scale: float = 1.0,
                 hidden: int = 100, meta_lr: float = 1e-3, meta_weight_decay: float = 1e-4,
                 virtual_lr: Optional[float] = None, class_prior=None, epoch_size: Optional[int] = None,
                 head: Optional[nn.Linear] = None, num_labels: Optional[int] = None, group_names=None):
        super().__init__(model)
        if virtual not in ("head", "all"):
            raise ValueError(f"virtual: expected 'head' or 'all', got {virtual!r}")
        self.virtual = virtual
        check_number("scale", scale, low=0.0, low_open=True)
        hidden = check_number("hidden", hidden, low=1, integer=True)
        self.meta_lr = check_number("meta_lr", meta_lr, low=0.0, low_open=True)
        check_number("meta_weight_decay", meta_weight_decay, low=0.0)
        self.virtual_lr = None if virtual_lr is None else check_number("virtual_lr", virtual_lr, low=0.0,
                                                                       low_open=True)
        self.epoch_size = None if epoch_size is None else check_number("epoch_size", epoch_size, low=1, integer=True)
        self.head = head if head is not None else find_head(self.model, num_labels)
        if not isinstance(self.head, nn.Linear):
            raise TypeError(f"head: expected the model's final nn.Linear, got {type(self.head).__name__}")
        self.num_classes = self.head.out_features
        if self.num_classes < 2:
            raise ValueError(f"head: expected at least two classes, got {self.num_classes}")
        self._meta_source = meta_batches
        self._meta_iter = None
        param = self.head.weight
        self.omega = PerturbationNet(hidden, scale).to(param.device)
        # capturable on a GPU: its step counter on the device, so that a whole step can be replayed (`plan_step`)
        self.omega_optimizer = torch.optim.Adam(self.omega.parameters(), lr=meta_lr, weight_decay=meta_weight_decay,
                                                capturable=param.is_cuda)
        C = self.num_classes
        if class_prior is not None:
            prior = torch.as_tensor(class_prior, dtype=torch.float32).flatten()
            if prior.numel() != C or not torch.isfinite(prior).all() or (prior < 0).any() or prior.sum() <= 0:
                raise ValueError(f"class_prior: expected {C} non-negative finite class frequencies, got {prior.tolist()}")
            prior = prior / prior.sum()
        self.fixed_prior = None if class_prior is None else prior.to(param.device)
        self._sums = torch.zeros(C, 3, device=param.device)  # this epoch: count, loss sum, margin sum per class
        # the last finished epoch's [C, 3] (prior, mean loss, mean margin), once one has ended; both buffers are
        # updated in place (a captured step writes them)
        self._last_buf = torch.zeros(C, 3, device=param.device)
        self._has_last = False
        self._seen = 0
        self._optimizer = None
        id2label = getattr(getattr(model, "config", None), "id2label", None) or {}
        self.diagnostics = CLPDiagnostics(C, scale, param.device, group_names,
                                          [id2label.get(c, str(c)) for c in range(C)])

    def epoch_record(self):
        """``{"clp_diagnostics": ...}``: the diagnostics since the last call (`CLPDiagnostics.record`; one host
        read), or None when no step ran; the CLI calls it at each epoch's end."""
        record = self.diagnostics.record()
        return None if record is None else {"clp_diagnostics": record}

    # ---- plumbing
    def set_optimizer(self, optimizer) -> None:
        self._optimizer = optimizer

    def _lr(self):
        """The virtual step's learning rate: ``virtual_lr``, or the optimizer's for the head (a tensor learning rate
        is used as it is: no host synchronisation, and a replayed step reads its current value)."""
        if self.virtual_lr is not None:
            return self.virtual_lr
        if self._optimizer is not None:
            for group in self._optimizer.param_groups:
                if any(p is self.head.weight for p in group["params"]):
                    lr = group["lr"]
                    return lr.detach() if isinstance(lr, torch.Tensor) else float(lr)
        raise ValueError("virtual_lr: not set and no optimizer holding the head's weight was given "
                         "(set_optimizer, which the trainers call, or virtual_lr=)")

    def _next_meta(self):
        if self._meta_iter is None:
            self._meta_iter = itertools.cycle(list(self._meta_source))
        try:
            return next(self._meta_iter)
        except StopIteration:
            raise ValueError("meta_batches: expected at least one batch") from None

    def _call(self, batch, params=None):
        """Logits and the head's input for `batch` (with `params`: through functional_call). The model's own forward
        runs (`models.uncompiled`): a compiled one would not run the hook on the head."""
        seen = {}

        def grab(module, args):
            seen["features"] = args[0]

        handle = self.head.register_forward_pre_hook(grab)
        try:
            with models.uncompiled(self.model) as model:
                if "input_ids" in batch or "inputs_embeds" in batch:
                    inputs = {k: v for k, v in batch.items() if k in _INPUTS or k == "inputs_embeds"}
                    if params is None:
                        out = model(**inputs)
                    else:
                        out = torch.func.functional_call(model, params, args=(), kwargs=inputs)
                    logits = models.logits_of(out)
                else:
                    if "inputs" not in batch:
                        raise ValueError("batch: expected tokenised inputs (input_ids, ...) or 'inputs' for a plain "
                                         "module")
                    logits = (model(batch["inputs"]) if params is None else
                              torch.func.functional_call(model, params, (batch["inputs"],)))
        finally:
            handle.remove()
        if "features" not in seen:
            raise ValueError("head: the model's forward did not call the head module")
        return logits, seen["features"]

    @property
    def _last(self):
        """The last finished epoch's [C, 3] statistics, or None before an epoch has ended."""
        return self._last_buf if self._has_last else None

    def class_stats(self, has_last=None) -> torch.Tensor:
        """[C, 3]: prior, mean loss and mean margin per class (the last epoch's; the current epoch's so far before
        one has ended). ``has_last``: whether an epoch has ended (default: now)."""
        if self._has_last if has_last is None else has_last:
            return self._last_buf
        return self._stats_of(self._sums)

    def _stats_of(self, sums):
        count = sums[:, 0]
        prior = self.fixed_prior if self.fixed_prior is not None else count / count.sum().clamp_min(1.0)
        denom = count.clamp_min(1.0)
        return torch.stack([prior, sums[:, 1] / denom, sums[:, 2] / denom], 1)

    # ---- one step
    def plan_step(self, batch, *args):
        """The host-side part of the next step (`cat_fast.step.CapturedStep`): the step count, the metadata batch
        (a static input of the graph), whether an epoch's statistics exist and whether this step ends an epoch
        (both select the graph). Not replayable under DDP (Ω's gradient is all-reduced inside the step)."""
        if self.distributed:
            raise NotCapturable("CLP under DistributedDataParallel all-reduces Ω's meta-gradient inside its step")
        self.step += 1
        has_last = self._has_last
        meta = self._next_meta()
        ends = self._advance(batch["labels"].shape[0])
        return StepPlan(key=("clp", has_last, ends), state=(has_last, ends), tensors={"meta": meta})

    def planned_step(self, plan, batch, pairs=None):
        """``(loss, info)`` of the step `plan` describes (`plan_step`), eagerly or inside a CUDA-graph capture."""
        has_last, ends = plan.state
        return self._step(batch, plan.tensors["meta"], has_last, ends)

    def __call__(self, batch, pairs=None):
        self.step += 1
        has_last = self._has_last
        meta = self._next_meta()
        seen = batch["labels"].shape[0]
        if self.distributed:  # the global batch, counted as B × world (the ranks' true sizes would cost a host sync)
            import torch.distributed as dist

            seen *= dist.get_world_size()
        return self._step(batch, meta, has_last, self._advance(seen))

    def _advance(self, seen):
        """Counts `seen` examples into the epoch (host state); whether this step ends an epoch."""
        self._seen += seen
        if self.epoch_size is None or self._seen < self.epoch_size:
            return False
        self._seen = 0
        self._has_last = True
        return True

    def _step(self, batch, meta_batch, has_last, ends):
        labels = batch["labels"]
        with torch.enable_grad():
            logits, features = self._call(batch)
        W = self.head.weight
        with torch.no_grad():
            acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
            chars = ops.sample_characteristics(logits.detach().to(acc), labels, features.detach().to(acc),
                                               W.detach().to(acc), self.class_stats(has_last).to(acc)).float()
        onehot = F.one_hot(labels.clamp_min(0), self.num_classes).to(logits.dtype)
        onehot = onehot * (labels >= 0).unsqueeze(1).to(logits.dtype)

        # meta step: Ω's gradient through a virtual step of the classifier
        self.omega.train()
        delta = self.omega(chars)
        lr = self._lr()
        if self.virtual == "head":
            meta_loss, before, step = self._meta_head(features.detach(), labels, onehot, delta, meta_batch, lr)
        else:
            meta_loss, before, step = self._meta_all(logits, labels, onehot, delta, meta_batch, lr)
        grads = torch.autograd.grad(meta_loss, list(self.omega.parameters()), allow_unused=True)
        self.omega_optimizer.zero_grad(set_to_none=True)
        for p, g in zip(self.omega.parameters(), grads):
            p.grad = g
        if self.distributed:  # Ω's meta-gradient is local to a rank's batch: averaged, so Ω stays equal on every rank
            from ..distributed import all_reduce_mean_

            all_reduce_mean_([p.grad for p in self.omega.parameters()])
        self.omega_optimizer.step()

        # the real step's loss, with Ω's new perturbation (no gradient to Ω)
        with torch.no_grad():
            delta_new = self.omega(chars)
        perturbed = logits + delta_new.to(logits.dtype).unsqueeze(1) * onehot
        loss = F.cross_entropy(upcast(perturbed), labels)
        self._update_stats(chars, labels, ends)
        if self.distributed:  # BatchNorm's running statistics saw this rank's batch only
            from ..distributed import all_reduce_mean_

            all_reduce_mean_([b for b in self.omega.buffers() if b.is_floating_point()])
        with torch.no_grad():
            info = {"ce_loss": F.cross_entropy(upcast(logits.detach()), labels), "meta_loss": meta_loss.detach(),
                    "delta_mean": delta_new.mean(), "delta_abs_mean": delta_new.abs().mean(),
                    **self.diagnostics.update(delta_new, labels, batch.get("diagnostic_group"), grads, before,
                                              meta_loss, step)}
        return loss, info

    def _meta_head(self, features, labels, onehot, delta, meta_batch, lr):
        """(metadata loss after the head's virtual step, before it, the step's norm)."""
        W, b = self.head.weight, self.head.bias
        z = F.linear(features.to(W.dtype), W, b)
        loss = F.cross_entropy(upcast(z + delta.to(z.dtype).unsqueeze(1) * onehot.to(z.dtype)), labels)
        params = [W] + ([b] if b is not None else [])
        grads = torch.autograd.grad(loss, params, create_graph=True)
        W2 = W - lr * grads[0]
        b2 = (b - lr * grads[1]) if b is not None else None
        with torch.no_grad():
            _, meta_features = self._call(meta_batch)
            meta_features = meta_features.detach().to(W.dtype)
            before = F.cross_entropy(upcast(F.linear(meta_features, W, b)), meta_batch["labels"])
        z_meta = F.linear(meta_features, W2, b2)
        return F.cross_entropy(upcast(z_meta), meta_batch["labels"]), before, lr * grad_norm(grads)

    def _meta_all(self, logits, labels, onehot, delta, meta_batch, lr):
        """As `_meta_head` for every trainable parameter; the loss before the step is a forward of its own (its
        own dropout draw)."""
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        params = [p for _, p in self.model.named_parameters() if p.requires_grad]
        loss = F.cross_entropy(upcast(logits + delta.to(logits.dtype).unsqueeze(1) * onehot), labels)
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        updated = {n: (p - lr * g if g is not None else p) for n, p, g in zip(names, params, grads)}
        meta_logits, _ = self._call(meta_batch, params=updated)
        with torch.no_grad():
            before = F.cross_entropy(upcast(self._call(meta_batch)[0]), meta_batch["labels"])
        return F.cross_entropy(upcast(meta_logits), meta_batch["labels"]), before, lr * grad_norm(grads)

    def _update_stats(self, chars, labels, ends):
        """Adds the batch to the epoch's sums (device only: the host counted the examples in `_advance`); at the end
        of an epoch its statistics become the last epoch's and the sums start again (in place)."""
        keep = labels >= 0
        idx = labels.clamp_min(0)
        rows = torch.stack([keep.float(), chars[:, 0] * keep, chars[:, 1] * keep], 1).to(self._sums.dtype)
        if self.distributed:  # the global batch's class statistics, equal on every rank
            import torch.distributed as dist

            rows = torch.zeros_like(self._sums).index_add_(0, idx, rows)
            dist.all_reduce(rows)
            idx = torch.arange(rows.shape[0], device=rows.device)
        self._sums.index_add_(0, idx, rows)
        if ends:
            self._last_buf.copy_(self._stats_of(self._sums))
            self._sums.zero_()

    def distributed_state(self):
        return list(self.omega.parameters()) + [b for b in self.omega.buffers() if b.is_floating_point()]

    # ---- checkpoints
    def state_dict(self) -> dict:
        state = super().state_dict()
        state.update(omega=self.omega.state_dict(), omega_optimizer=self.omega_optimizer.state_dict(),
                     sums=self._sums.clone(), last=None if self._last is None else self._last.clone(), seen=self._seen,
                     diagnostics=self.diagnostics.state_dict())
        return state

    def load_state_dict(self, state) -> None:
        super().load_state_dict(state)
        if "omega" in state:
            self.omega.load_state_dict(state["omega"])
            self.omega_optimizer.load_state_dict(state["omega_optimizer"])
            self._sums.copy_(state["sums"])
            self._has_last = state["last"] is not None
            if self._has_last:
                self._last_buf.copy_(state["last"])
            self._seen = int(state["seen"])
            if "diagnostics" in state:
                self.diagnostics.load_state_dict(state["diagnostics"])
