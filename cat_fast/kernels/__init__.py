"""Backends of the fused ops: `reference` (pure PyTorch, the oracle) and `triton`; the C++/CUDA ones are in csrc/."""
