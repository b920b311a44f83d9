"""Argument checks for every op, done once in the Python wrapper before dispatch.

Each failure raises TypeError (wrong type or dtype) or ValueError (shape, device, range) whose
message names the argument and what was expected. Value-range checks of index tensors (partner,
labels) would force a GPU->CPU sync, so they run only on CPU tensors, or on CUDA when
`CAT_FAST_DEBUG=1` (the CUDA kernels can also be built with `-DCAT_FAST_DEVICE_CHECKS` for
device-side asserts).
"""
import math
import os

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _debug():
    return os.environ.get("CAT_FAST_DEBUG", "0") == "1"


def _can_read_values(tensor):
    if torch.compiler.is_compiling():
        return False
    return tensor.device.type == "cpu" or _debug()


def tensor(name, value, ndims=None, dtypes=FLOAT_DTYPES):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if ndims is not None and value.dim() not in ndims:
        wanted = " or ".join(f"{n}-D" for n in ndims)
        raise ValueError(f"{name}: expected a {wanted} tensor, got shape {tuple(value.shape)}")
    if dtypes is not None and value.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({names}), got {str(value.dtype).replace('torch.', '')}")
    return value


def same_device(**tensors):
    named = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, value in named[1:]:
        if value.device != first.device:
            raise ValueError(f"{name}: expected a tensor on {first.device} (the device of {first_name}), got {value.device}")


def size(name, value, dim, expected, what):
    if value.shape[dim] != expected:
        raise ValueError(f"{name}: expected size {expected} in dim {dim} ({what}), got shape {tuple(value.shape)}")


def shape(name, value, expected, what):
    if tuple(value.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)} ({what}), got {tuple(value.shape)}")


def dtype_like(name, value, like_name, like):
    if value.dtype != like.dtype:
        raise TypeError(f"{name}: expected dtype {str(like.dtype).replace('torch.', '')} (the dtype of {like_name}), "
                        f"got {str(value.dtype).replace('torch.', '')}")


def index_range(name, value, upper, what, ignore_index=None):
    """Values of `value` in [0, upper); with `ignore_index`, that value is allowed too (rows to skip)."""
    if value.numel() == 0 or not _can_read_values(value):
        return
    low, high = int(value.min()), int(value.max())
    if (low < 0 or high >= upper) and ignore_index is not None:  # look again without the ignored values
        kept = value[value != ignore_index]
        if kept.numel() == 0:
            return
        low, high = int(kept.min()), int(kept.max())
    if low < 0 or high >= upper:
        also = "" if ignore_index is None else f" or ignore_index={ignore_index}"
        raise ValueError(f"{name}: expected values in [0, {upper}) ({what}){also}, got values in [{low}, {high}]")


def choice(name, value, options):
    if value not in options:
        raise ValueError(f"{name}: expected one of {options}, got {value!r}")


def number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    return float(value)


def not_nan(name, value):
    """A number (see `number`) that is not NaN; +-inf are allowed. Returns it as a float."""
    value = number(name, value)
    if math.isnan(value):
        raise ValueError(f"{name}: expected a number that is not NaN (+-inf allowed), got nan")
    return value


def index_value(name, value):
    """A Python int (not a bool) that fits in int64, e.g. `ignore_index`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{name}: expected an int64 value, got {value}")
    return value


def nonempty_batch(name, value):
    if value.shape[0] == 0:
        raise ValueError(f"{name}: expected at least one row (batch size B >= 1), got shape {tuple(value.shape)}")


def classes(name, logits, labels, ignore_index=None):
    tensor(name, logits, ndims=(2,))
    nonempty_batch(name, logits)
    if logits.shape[1] < 1:
        raise ValueError(f"{name}: expected at least one class (C >= 1), got shape {tuple(logits.shape)}")
    tensor("labels", labels, ndims=(1,), dtypes=(torch.int64, torch.int32))
    same_device(**{name: logits, "labels": labels})
    size("labels", labels, 0, logits.shape[0], f"batch size of {name}")
    index_range("labels", labels, logits.shape[1], f"class indices of {name}", ignore_index)
