"""`cat_fast.step_updates.BackwardUpdates`: the optimizer stepped group by group during the backward, the plain
step bit for bit (here inline on the CPU; on CUDA through `CapturedStep` with ``OVERLAP_UPDATE``, in
tests/test_step.py)."""
import pytest
import torch

from cat_fast import step as step_module
from cat_fast.objectives import ERM
from cat_fast.step import CapturedStep
from cat_fast.step_updates import BackwardUpdates
from tests.conftest import tiny_batch, tiny_model


def _updated(groups, optimizer_kind, steps=3):
    """Parameters after `steps` AdamW/SGD steps of ERM on a tiny BERT: plain (`groups` None) or by
    `BackwardUpdates`; and the groups it stepped during its last backward."""
    torch.manual_seed(0)
    model = tiny_model("bert", seed=1).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1) if optimizer_kind == "adamw"
           else torch.optim.SGD(params, lr=1e-1, momentum=0.9))
    objective = ERM(model)
    updates = BackwardUpdates(opt, params, groups) if groups is not None else None
    for i in range(steps):
        loss, _ = objective(tiny_batch("bert", batch=4, length=9, seed=i))
        if updates is None:
            loss.backward()
            opt.step()
        else:
            with updates.during():
                loss.backward()
            updates.finish()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, updates.launched if updates else 0


@pytest.mark.parametrize("optimizer_kind", ["adamw", "sgd"])
@pytest.mark.parametrize("groups", [1, 4, 1000])
def test_the_groups_stepped_during_the_backward_give_the_plain_step(groups, optimizer_kind):
    """Each parameter stepped once, with its final gradient, while the backward goes on: the plain step's
    parameters bit for bit (dropout on: the forward's draws are the same); one group steps when the last gradient
    is final, four in two to four steps (the last parameters' at `finish`), 1,000 in many."""
    want, _ = _updated(None, optimizer_kind)
    got, launched = _updated(groups, optimizer_kind)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert {1: launched == 1, 4: 2 <= launched <= 4, 1000: launched > 8}[groups], launched


def test_a_second_accumulation_after_a_group_stepped_raises():
    """The failure that would be silent: a parameter accumulated again after its group stepped (two backwards in
    one window, the second reading nothing the update changed; a model's would trip autograd's version check
    first) would be stepped with part of its gradient; it raises instead."""
    w = torch.nn.Parameter(torch.ones(3))
    updates = BackwardUpdates(torch.optim.SGD([w], lr=0.1), [w], groups=1)
    loss = (w * torch.arange(3.0)).sum()
    with pytest.raises(RuntimeError, match="accumulated again after its group stepped"):
        with updates.during():
            loss.backward(retain_graph=True)
            loss.backward()


def test_bad_arguments_and_finish_without_a_backward():
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = torch.optim.SGD(params, lr=0.1)
    for groups in (0, 1.5, True):
        with pytest.raises(ValueError, match="groups must be an integer >= 1"):
            BackwardUpdates(opt, params, groups)
    with pytest.raises(RuntimeError, match="no backward ran within during"):
        BackwardUpdates(opt, params).finish()


def test_the_overlap_switch_is_checked_and_stays_off_the_cpu(monkeypatch):
    """`step.OVERLAP_UPDATE`: True on a CPU model changes nothing (no stream to overlap on: the plain update);
    a value other than True or False raises naming it."""
    model = tiny_model("bert", seed=1)
    step = CapturedStep(ERM(model), torch.optim.AdamW(model.parameters(), lr=1e-3), cuda_graph=False)
    monkeypatch.setattr(step_module, "OVERLAP_UPDATE", True)
    assert step._backward_updates() is None
    monkeypatch.setattr(step_module, "OVERLAP_UPDATE", "yes")
    with pytest.raises(ValueError, match="step.OVERLAP_UPDATE: expected True or False, got 'yes'"):
        step._backward_updates()
