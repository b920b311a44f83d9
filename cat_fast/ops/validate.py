"""Argument checks for every op, done once in the Python wrapper before dispatch.

Each failure raises TypeError (wrong type or dtype) or ValueError (shape, device, range) whose
message names the argument and what was expected. Every scalar argument of every op follows one rule: each op
module lists its scalars in a `SCALARS` table (name -> range) checked by `scalars` (floats: `scalar`, finite and in
range; ints: `index_value`), in the functional op and in its `torch.nn.Module` wrapper alike. Value-range checks
of index tensors (partner, labels) would force a GPU->CPU sync, so they run only on CPU tensors, or on CUDA when
`CAT_FAST_DEBUG=1` (the CUDA kernels can also be built with `-DCAT_FAST_DEVICE_CHECKS` for device-side asserts).
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


def _bounds(low, high, open_low, open_high):
    if low is None and high is None:
        return ""
    if high is None:
        return f" {'>' if open_low else '>='} {low:g}"
    if low is None:
        return f" {'<' if open_high else '<='} {high:g}"
    return f" in {'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"


def scalar(name, value, low=None, high=None, open_low=False, open_high=False, finite=True, what="number"):
    """The one rule for an op's float scalar arguments: a real number (int or float, not a bool), not NaN, finite
    (``finite=False`` only for a bound whose infinity means "no bound", e.g. a clip range), in [low, high]
    (``open_low`` / ``open_high``: that end excluded; None: no bound). Returns it as a float; TypeError or
    ValueError naming `name` and the range otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond the float range
        value = math.inf if value > 0 else -math.inf
    below = low is not None and (value < low or (open_low and value == low))
    above = high is not None and (value > high or (open_high and value == high))
    if math.isnan(value) or (finite and math.isinf(value)) or below or above:
        bounds = _bounds(low, high, open_low, open_high)
        if finite:
            raise ValueError(f"{name}: expected a finite {what}{bounds}, got {value}")
        raise ValueError(f"{name}: expected a {what} that is not NaN (+-inf allowed){bounds}, got {value}")
    return value


def index_value(name, value):
    """The rule for an op's int scalar arguments: a Python int (not a bool) that fits in int64, e.g. `ignore_index`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{name}: expected an int64 value, got {value}")
    return value


INT = {"int": True}  # a `SCALARS` entry for an int argument (`index_value`)


def scalars(table, **values):
    """Every argument of `values` checked by its entry of `table` (name -> `scalar`'s keyword arguments, or `INT`),
    returned as a tuple in the order given."""
    return tuple(index_value(n, v) if table[n] is INT else scalar(n, v, **table[n]) for n, v in values.items())


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
