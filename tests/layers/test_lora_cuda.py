"""The fast layers over peft LoRA projections on a GPU: the fused training layer (an fp32 layer under bf16 autocast,
enough rows for the Triton kernels) against the peft layer to 16-bit rounding, and a captured ERM step of a LoRA
model against the eager loop (`tests/layers/test_lora.py` checks the same in float64 on the CPU)."""
import warnings

import pytest
import torch

from cat_fast import models
from cat_fast.layers import layout, training
from cat_fast.objectives import ERM
from cat_fast.step import CapturedStep
from tests.conftest import tiny_batch, tiny_model

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _lora_model(targets, **config):
    model = tiny_model("bert", attn="sdpa", num_layers=2, **config)
    peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # peft starts B at 0, where the adapters add nothing
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    for p in models.structure(model).head.parameters():
        p.requires_grad_(True)
    return model.cuda()


@pytest.mark.parametrize("targets", [["query", "value"], ["dense"]], ids=["query-value", "dense"])
@pytest.mark.parametrize("train", [False, True])
def test_fused_training_layer_over_lora_agrees_to_16_bit_rounding(targets, train, monkeypatch):
    # the hidden dropouts as the peft layer draws them (torch.native_dropout's), not in the LayerNorm kernel: the
    # kernel's own draws are checked against the unfused path in tests/layers/test_training.py
    monkeypatch.setattr(training, "OWN_DROPOUT", False)
    model = _lora_model(targets, hidden_size=64, num_attention_heads=4, intermediate_size=256)
    layer = models.structure(model).layer_modules[1].train(train)
    assert any(layout.lora(m) for m in layer.modules()) and training.supported(layer)
    x = torch.randn(16, 64, 64, device="cuda")
    assert training.fusion(x, torch.bfloat16, torch.float32) is not None  # 1,024 rows: the Triton kernels run
    lengths = torch.randint(32, 65, (16,), generator=torch.Generator().manual_seed(1))
    mask = models.inputs._padding_mask_4d((torch.arange(64) < lengths[:, None]).long()).cuda()
    g = torch.randn(16, 64, 64, device="cuda")
    wrt = [p for p in layer.parameters() if p.requires_grad]
    assert wrt and all("lora_" in n for n, p in layer.named_parameters() if p.requires_grad)
    results = []
    for run in (lambda t: layer(t, mask), lambda t: training.forward(layer, (t, mask), {})):
        torch.manual_seed(3)
        t = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = run(t)
        y = y[0] if isinstance(y, tuple) else y
        results.append((y, torch.autograd.grad(y, [t, *wrt], g)))
    (y_own, g_own), (y, grads) = results
    assert y.dtype == y_own.dtype == torch.float32
    torch.testing.assert_close(y, y_own, rtol=2e-2, atol=2e-2)
    for a, b in zip(grads, g_own):
        assert b.abs().max() > 0
        assert (a - b).abs().max() / b.abs().max() < 3e-2


def test_captured_erm_step_over_lora_equals_the_eager_loop():
    """Six steps with dropout, fused AdamW over the adapters and the head: the captured fast step (3 warm-up steps,
    the capture, replays) leaves the parameters and losses of the eager loop of the same step."""
    batches = [{k: v.cuda() for k, v in tiny_batch("bert", batch=4, length=9, seed=i).items()} for i in range(6)]
    runs = []
    for captured in (False, True):
        model = _lora_model(["query", "value", "dense"]).train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=torch.tensor(1e-2, device="cuda"), capturable=True)
        torch.manual_seed(0)
        objective = ERM(model, fast=True)
        losses = []
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            if captured:
                step = CapturedStep(objective, opt, max_grad_norm=1.0)
                losses = [step(b)[0] for b in batches]
                assert step.num_graphs == 1
            else:
                for b in batches:
                    loss, _ = objective(b)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    losses.append(loss.detach())
        runs.append(({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
                     torch.stack(losses)))
    (want, want_losses), (got, got_losses) = runs
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-6, atol=1e-6)
    moved = 0.0
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)
    first = _lora_model(["query", "value", "dense"])
    for n, p in first.named_parameters():
        if n in want:
            moved = max(moved, float((want[n] - p.detach()).abs().max()))
    assert moved > 1e-3  # the steps changed the adapters
