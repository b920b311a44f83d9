"""Interventions left in effect until the interpreter exits (a masked model) leave nothing to report at exit."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MASKED_UNTIL_EXIT = """
import torch
from cat_fast.analysis import masking
from tests.conftest import tiny_batch, tiny_model

model = tiny_model("bert").eval()
masking.mask_neurons(model, [(1, "intermediate", 5), (2, "query", 3), (3, "value", 0)], factor=0.0)
batch = tiny_batch("bert", batch=2)
model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
print("masked forward ok")
"""


def test_a_mask_held_until_exit_prints_nothing_at_exit():
    out = subprocess.run([sys.executable, "-c", MASKED_UNTIL_EXIT], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "masked forward ok" in out.stdout
    assert "Exception ignored" not in out.stderr, out.stderr[-3000:]
