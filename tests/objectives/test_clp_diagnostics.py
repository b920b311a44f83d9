"""CLP's per-epoch diagnostics (cat_fast.objectives.clp_diagnostics) equal a plain recomputation: δ' per class and
per (class, group) from Ω on the batch's characteristics, the meta-gradient's norm, the metadata loss before and
after the virtual step and the step's size; `epoch_record` reads them once and starts again."""
import copy

import torch
import torch.nn.functional as F

from cat_fast import ops
from cat_fast.objectives.clp import CLP
from tests.objectives.test_clp import Plain, _plain_batches


def _recompute(obj, model, batch, meta, stats, omega_before):
    """δ' (Ω after its step, on the batch's characteristics), the norm of Ω's meta-gradient, the metadata loss
    before / after the head's virtual step and the step's norm, all from scratch."""
    captured = {}
    handle = model.head.register_forward_pre_hook(lambda m, a: captured.__setitem__("h", a[0]))
    logits = model(batch["inputs"])
    handle.remove()
    h, y = captured["h"].detach(), batch["labels"]
    W, b = model.head.weight, model.head.bias
    chars = ops.sample_characteristics(logits.detach(), y, h, W.detach(), stats).float()
    delta_new = obj.omega(chars).detach()
    omega = copy.deepcopy(omega_before)
    delta = omega(chars)
    onehot = F.one_hot(y, 3).to(logits.dtype)
    loss = F.cross_entropy(F.linear(h, W, b) + delta.to(h.dtype)[:, None] * onehot, y)
    gW, gb = torch.autograd.grad(loss, [W, b], create_graph=True)
    lr = obj.virtual_lr
    meta_h = model.body(meta["inputs"]).tanh().detach()
    after = F.cross_entropy(F.linear(meta_h, W - lr * gW, b - lr * gb), meta["labels"])
    before = F.cross_entropy(F.linear(meta_h, W, b), meta["labels"]).detach()
    grads = torch.autograd.grad(after, list(omega.parameters()))
    norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
    step = lr * torch.sqrt(gW.pow(2).sum() + gb.pow(2).sum()).detach()
    return delta_new, float(norm), float(before), float(after.detach()), float(step)


def test_diagnostics_equal_a_plain_recomputation():
    torch.manual_seed(0)
    model = Plain()
    batches = _plain_batches(2, b=12, seed=3)
    meta = _plain_batches(1, b=6, seed=4)[0]
    groups = torch.tensor([0, 1, 1, 0, 2, 1, 0, 0, 2, 1, 0, 1])
    obj = CLP(model, [meta], virtual_lr=0.3, scale=0.5, group_names=["a", "b", "c"])
    with torch.no_grad():
        obj.omega.fc2.bias.fill_(0.3)
    expected = {"n": {}, "sum": {}, "abs": {}, "near": {}}
    scalars = []
    for batch in batches:
        stats = obj.class_stats().clone().double()
        omega_before = copy.deepcopy(obj.omega)
        obj.omega.train()
        obj({**batch, "diagnostic_group": groups})
        d, norm, before, after, step = _recompute(obj, model, batch, meta, stats, omega_before)
        scalars.append((norm, before, after, step))
        for i, (y, g) in enumerate(zip(batch["labels"].tolist(), groups.tolist())):
            key = f"{y}/{'abc'[g]}"
            for name, value in (("n", 1.0), ("sum", float(d[i])), ("abs", float(d[i].abs())),
                                ("near", float(d[i].abs() >= 0.99 * 0.5))):
                expected[name][key] = expected[name].get(key, 0.0) + value
    record = obj.epoch_record()["clp_diagnostics"]
    assert record["steps"] == 2 and record["bound"] == 0.5
    assert set(record["per_group"]) == set(expected["n"])
    for key, cell in record["per_group"].items():
        n = expected["n"][key]
        assert cell["n"] == n
        assert abs(cell["delta_mean"] - expected["sum"][key] / n) < 1e-5
        assert abs(cell["delta_abs_mean"] - expected["abs"][key] / n) < 1e-5
        assert abs(cell["near_bound"] - expected["near"][key] / n) < 1e-9
    for c in range(3):
        n = sum(v for k, v in expected["n"].items() if k.startswith(f"{c}/"))
        assert record["per_class"][str(c)]["n"] == n
    mean = [sum(s[i] for s in scalars) / 2 for i in range(4)]
    for key, value in zip(("meta_grad_norm", "meta_loss_before", "meta_loss_after", "virtual_step"), mean):
        assert abs(record[key] - value) < 1e-4 * max(1.0, abs(value)), (key, record[key], value)
    assert abs(record["meta_grad_norm_max"] - max(s[0] for s in scalars)) < 1e-4
    assert abs(record["meta_loss_change"] - (mean[2] - mean[1])) < 1e-5
    assert obj.epoch_record() is None  # read once: the buffers start again
