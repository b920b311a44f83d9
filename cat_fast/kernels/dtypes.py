"""Accumulation dtypes shared by every backend: float64 stays float64, everything else accumulates in float32."""
import torch

__all__ = ["acc_dtype", "upcast"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and reductions of a `dtype` input run in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def upcast(x: torch.Tensor) -> torch.Tensor:
    """`x` in float32 when it is 16-bit (float16, bfloat16), else `x` itself."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
