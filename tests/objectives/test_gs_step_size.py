"""First-order GS's default step follows the precision (`gs_first_order.step_size`): where the matmuls run in 16 bits
(`EPS_16_BIT`) it keeps the parameter term close to the exact double backward's under bf16 autocast, where a step of
1e-3 drowns in bf16 rounding; fp32 (`EPS`) and float64 (`EPS_FLOAT64`) take smaller steps."""
import torch
import torch.nn.functional as F

from cat_fast.objectives import GradientSupervision
from cat_fast.objectives.gs_first_order import EPS, EPS_16_BIT, EPS_FLOAT64, step_size
from tests.conftest import tiny_model
from tests.objectives.test_gs import LABELS, PAIRS, backward_grads, batch_f


def _gs_term(model, autocast, **kw):
    """The GS part of the parameter gradient (the gradient of the loss less that of its CE part)."""
    batch = batch_f()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss, info = GradientSupervision(model, weight=1.0, representation=0, **kw)(batch, PAIRS)
        ce = F.cross_entropy(model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float(), LABELS)
    return backward_grads(model, loss - ce)


def test_the_default_step_follows_the_precision():
    x32, x16, x64 = torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float64)
    assert step_size(None, x32) == EPS == 1e-2 and step_size(None, x16) == EPS_16_BIT
    assert step_size(None, x64) == EPS_FLOAT64 < EPS < EPS_16_BIT
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert step_size(None, x32) == EPS_16_BIT
        assert step_size(0.02, x32) == 0.02  # a given step is kept
    assert GradientSupervision(tiny_model("bert"), mode="first_order").eps is None


def test_under_bf16_autocast_the_default_step_tracks_the_exact_term():
    model = tiny_model("bert", attn="eager", hidden_size=64, num_attention_heads=4, intermediate_size=128).eval()
    exact = _gs_term(model, True, mode="exact")
    default = _gs_term(model, True, mode="first_order")
    fp32_step = _gs_term(model, True, mode="first_order", eps=1e-3)
    cos = [float(F.cosine_similarity(g, exact, dim=0)) for g in (default, fp32_step)]
    assert exact.abs().max() > 1e-6
    assert cos[0] > 0.95 and cos[1] < cos[0] - 0.1, cos


def test_in_fp32_the_default_step_tracks_the_exact_term():
    model = tiny_model("bert", attn="eager", hidden_size=64, num_attention_heads=4, intermediate_size=128).eval()
    exact = _gs_term(model, False, mode="exact")
    cos = {eps: float(F.cosine_similarity(_gs_term(model, False, mode="first_order", eps=eps), exact, dim=0))
           for eps in (None, 0.3)}
    assert exact.abs().max() > 1e-6
    assert cos[None] > 0.9999 and cos[0.3] < cos[None], cos  # a step too large shows its truncation error
