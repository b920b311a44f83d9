"""A fullgraph torch.compile works when the compiled call is the process's first op call (backend discovery must not
run inside tracing)."""
import subprocess
import sys

FIRST_CALL_COMPILED = """
import torch
from cat_fast.ops import cmix, crm_loss

def step(h, lam, partner, logits, cf_logits, labels):
    return cmix(h, lam, partner)[0].square().mean() + crm_loss(logits, cf_logits, labels)

h, lam, partner = torch.randn(4, 3, 8), torch.rand(4), torch.tensor([1, 0, 3, 2])
logits, cf_logits, labels = torch.randn(4, 3), torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
compiled = torch.compile(step, fullgraph=True)(h, lam, partner, logits, cf_logits, labels)
torch.testing.assert_close(compiled, step(h, lam, partner, logits, cf_logits, labels))
print("compiled first call ok")
"""


def test_fullgraph_compile_as_the_first_op_call():
    out = subprocess.run([sys.executable, "-c", FIRST_CALL_COMPILED], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "compiled first call ok" in out.stdout
