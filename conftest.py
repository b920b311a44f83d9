"""Test-session set-up shared by tests/ and benchmarks/.

Without a CUDA device, Triton kernels run under Triton's interpreter on CPU tensors, so the Triton
backend is tested in CI too. The variable must be set before triton (and so cat_fast) is imported.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
