"""One rule for every op's scalar arguments (`cat_fast.ops.validate.scalar` / `index_value`): a real number, not
NaN, finite unless it is a bound whose infinity means "no bound", and in its range; errors name the argument."""
import importlib
import inspect
import math

import pytest
import torch

from cat_fast import ops
from cat_fast.ops import modules, validate

from .conftest import run

# the op modules (the package's names of the same spelling are the functions)
(bias_losses, cal_objective, cal_step, cmix, crm_loss, gs_cosine_loss, sample_characteristics) = (
    importlib.import_module(f"cat_fast.ops.{name}") for name in (
        "bias_losses", "cal_objective", "cal_step", "cmix", "crm_loss", "gs_cosine_loss", "sample_characteristics"))

NAN, INF = float("nan"), float("inf")


def _logits():
    return torch.randn(3, 2, generator=torch.Generator().manual_seed(0))


def _labels():
    return torch.tensor([0, 1, 1])


def _bias():
    return torch.randn(3, 2).log_softmax(-1)


CALLS = {  # op name -> (function of the keyword arguments under test, the module whose SCALARS it checks)
    "cal_objective": (lambda **kw: ops.cal_objective(_logits(), _labels(), **kw), cal_objective),
    "cal_step_": (lambda **kw: ops.cal_step_(torch.rand(3), torch.randn(3), **{"lr": 0.1, **kw}), cal_step),
    "gs_cosine_loss": (lambda **kw: ops.gs_cosine_loss(torch.randn(3, 4), torch.randn(3, 4), **kw), gs_cosine_loss),
    "crm_loss": (lambda **kw: ops.crm_loss(_logits(), torch.randn(3, 2), _labels(), **kw), crm_loss),
    "crm_weights": (lambda **kw: ops.crm_weights(_logits(), torch.randn(3, 2), **kw), crm_loss),
    "cmix": (lambda **kw: ops.cmix(torch.randn(3, 2, 4), kw["lam"], torch.tensor([1, 2, 0])), cmix),
    "poe_loss": (lambda **kw: ops.poe_loss(_logits(), _bias(), _labels(), **kw), bias_losses),
    "learned_mixin_loss": (lambda **kw: ops.learned_mixin_loss(_logits(), _bias(), _labels(), torch.randn(3), **kw),
                           bias_losses),
    "sample_characteristics": (lambda **kw: ops.sample_characteristics(
        _logits(), _labels(), torch.randn(3, 4), torch.randn(2, 4), torch.rand(2, 3), **kw), sample_characteristics),
    "CALObjective": (lambda **kw: modules.CALObjective(**kw), cal_objective),
    "CRMLoss": (lambda **kw: modules.CRMLoss(**kw), crm_loss),
    "GSCosineLoss": (lambda **kw: modules.GSCosineLoss(**kw), gs_cosine_loss),
}

BAD = [  # (op, argument, bad value, error, words in the message)
    ("cal_objective", "gamma", NAN, ValueError, "gamma: expected a finite number, got nan"),
    ("cal_objective", "gamma", INF, ValueError, "gamma: expected a finite number, got inf"),
    ("cal_objective", "eta", NAN, ValueError, "eta: expected a finite number, got nan"),
    ("cal_objective", "eta", -INF, ValueError, "eta: expected a finite number, got -inf"),
    ("cal_objective", "eta", 10**400, ValueError, "eta: expected a finite number, got inf"),
    ("cal_objective", "ignore_index", NAN, TypeError, "ignore_index: expected an int"),
    ("cal_objective", "ignore_index", 2**63, ValueError, "ignore_index: expected an int64 value"),
    ("cal_step_", "lr", NAN, ValueError, "lr: expected a finite number >= 0, got nan"),
    ("cal_step_", "lr", INF, ValueError, "lr: expected a finite number >= 0, got inf"),
    ("cal_step_", "lr", -1.0, ValueError, "lr: expected a finite number >= 0, got -1.0"),
    ("cal_step_", "p", NAN, ValueError, "p: expected a finite norm order >= 1, got nan"),
    ("cal_step_", "p", INF, ValueError, "p: expected a finite norm order >= 1, got inf"),
    ("cal_step_", "p", 0.5, ValueError, "p: expected a finite norm order >= 1, got 0.5"),
    ("cal_step_", "lo", NAN, ValueError, "lo: expected a number that is not NaN (+-inf allowed), got nan"),
    ("cal_step_", "hi", NAN, ValueError, "hi: expected a number that is not NaN (+-inf allowed), got nan"),
    ("cal_step_", "hi", -1.0, ValueError, "lo, hi: expected lo <= hi"),
    ("cal_step_", "lr", "0.1", TypeError, "lr: expected a number, got str"),
    ("gs_cosine_loss", "eps", NAN, ValueError, "eps: expected a finite number > 0, got nan"),
    ("gs_cosine_loss", "eps", INF, ValueError, "eps: expected a finite number > 0, got inf"),
    ("gs_cosine_loss", "eps", 0.0, ValueError, "eps: expected a finite number > 0, got 0.0"),
    ("gs_cosine_loss", "eps", -1e-8, ValueError, "eps: expected a finite number > 0"),
    ("crm_loss", "a1", NAN, ValueError, "a1: expected a number that is not NaN (+-inf allowed), got nan"),
    ("crm_loss", "a2", NAN, ValueError, "a2: expected a number that is not NaN (+-inf allowed), got nan"),
    ("crm_loss", "a2", -1.0, ValueError, "a1, a2: expected a1 <= a2"),
    ("crm_loss", "ignore_index", 0.5, TypeError, "ignore_index: expected an int"),
    ("crm_weights", "a1", NAN, ValueError, "a1: expected a number that is not NaN"),
    ("crm_weights", "a1", INF, ValueError, "a1, a2: expected a1 <= a2"),
    ("crm_weights", "a2", NAN, ValueError, "a2: expected a number that is not NaN"),
    ("cmix", "lam", NAN, ValueError, "lam: expected a finite number, got nan"),
    ("cmix", "lam", INF, ValueError, "lam: expected a finite number, got inf"),
    ("cmix", "lam", -INF, ValueError, "lam: expected a finite number, got -inf"),
    ("poe_loss", "ignore_index", True, TypeError, "ignore_index: expected an int, got bool"),
    ("learned_mixin_loss", "entropy_weight", NAN, ValueError, "entropy_weight: expected a finite number >= 0"),
    ("learned_mixin_loss", "entropy_weight", INF, ValueError, "entropy_weight: expected a finite number >= 0"),
    ("learned_mixin_loss", "entropy_weight", -0.1, ValueError, "entropy_weight: expected a finite number >= 0"),
    ("learned_mixin_loss", "ignore_index", -(2**63) - 1, ValueError, "ignore_index: expected an int64 value"),
    ("sample_characteristics", "eps", NAN, ValueError, "eps: expected a finite number > 0, got nan"),
    ("sample_characteristics", "eps", INF, ValueError, "eps: expected a finite number > 0, got inf"),
    ("sample_characteristics", "eps", 0, ValueError, "eps: expected a finite number > 0, got 0.0"),
    ("sample_characteristics", "ignore_index", "x", TypeError, "ignore_index: expected an int"),
    ("CALObjective", "gamma", NAN, ValueError, "gamma: expected a finite number, got nan"),
    ("CALObjective", "eta", INF, ValueError, "eta: expected a finite number, got inf"),
    ("CALObjective", "eta", NAN, ValueError, "eta: expected a finite number, got nan"),
    ("CRMLoss", "a1", NAN, ValueError, "a1: expected a number that is not NaN"),
    ("CRMLoss", "a2", NAN, ValueError, "a2: expected a number that is not NaN"),
    ("CRMLoss", "ignore_index", 2.0, TypeError, "ignore_index: expected an int"),
    ("GSCosineLoss", "eps", NAN, ValueError, "eps: expected a finite number > 0, got nan"),
    ("GSCosineLoss", "eps", INF, ValueError, "eps: expected a finite number > 0, got inf"),
]


@pytest.mark.parametrize("op, name, value, error, words", BAD, ids=[f"{o}-{n}-{v!r}"[:60] for o, n, v, *_ in BAD])
def test_a_bad_scalar_is_refused_naming_the_argument(op, name, value, error, words):
    call, _ = CALLS[op]
    with pytest.raises(error) as caught:
        call(**{name: value})
    assert words in str(caught.value)


def test_every_scalar_of_every_op_is_in_its_table_and_tested_with_nan():
    """Each wrapper's numeric parameters are its module's SCALARS, and the table above gives each a NaN (or, for an
    int, a non-int)."""
    functions = {"cal_objective": cal_objective.cal_objective, "cal_step_": cal_step.cal_step_,
                 "gs_cosine_loss": gs_cosine_loss.gs_cosine_loss, "crm_loss": crm_loss.crm_loss,
                 "crm_weights": crm_loss.crm_weights, "poe_loss": bias_losses.poe_loss,
                 "learned_mixin_loss": bias_losses.learned_mixin_loss,
                 "sample_characteristics": sample_characteristics.sample_characteristics,
                 "CALObjective": modules.CALObjective.__init__, "CRMLoss": modules.CRMLoss.__init__,
                 "GSCosineLoss": modules.GSCosineLoss.__init__}
    for op, fn in functions.items():
        params = inspect.signature(fn).parameters
        numeric = {n for n, p in params.items() if type(p.default) in (int, float)} | ({"lr"} if op == "cal_step_"
                                                                                        else set())
        table = CALLS[op][1].SCALARS
        assert numeric <= set(table), (op, numeric - set(table))
        for name in numeric:
            tested = [v for o, n, v, *_ in BAD if o == op and n == name]
            assert any(isinstance(v, float) and math.isnan(v) for v in tested) or table[name] is validate.INT, (op, name)
    assert set(cmix.SCALARS) == {"lam"}


@pytest.mark.parametrize("op, kwargs", [
    ("cal_objective", dict(gamma=-2.5, eta=0)), ("cal_step_", dict(lr=0.0, p=3, lo=-INF, hi=INF)),
    ("crm_loss", dict(a1=-INF, a2=INF)), ("cmix", dict(lam=2)), ("gs_cosine_loss", dict(eps=1)),
    ("learned_mixin_loss", dict(entropy_weight=0)), ("sample_characteristics", dict(eps=1e-30)),
    ("CRMLoss", dict(a1=0.9, a2=INF)),
])
def test_values_in_range_are_accepted(op, kwargs):
    CALLS[op][0](**kwargs)


def test_infinite_clamp_bounds_of_cal_step_match_the_reference(backend, device):
    gen = torch.Generator().manual_seed(3)
    lam = (torch.rand(4, 3, generator=gen) * 4 - 2).to(device)
    grad = torch.randn(4, 3, generator=gen).to(device)
    for lo, hi in ((-INF, INF), (-INF, 0.5), (0.0, INF)):
        want = run("reference", ops.cal_step_, lam.clone(), grad, 0.5, 2.0, lo, hi)
        got = run(backend, ops.cal_step_, lam.clone(), grad, 0.5, 2.0, lo, hi)
        torch.testing.assert_close(got, want)


def test_scalar_helper_bounds():
    assert validate.scalar("x", 3) == 3.0 and isinstance(validate.scalar("x", 3), float)
    with pytest.raises(ValueError, match=r"x: expected a finite number in \[0, 1\), got 1.0"):
        validate.scalar("x", 1, low=0, high=1, open_high=True)
    with pytest.raises(ValueError, match=r"x: expected a finite number <= 1, got 2.0"):
        validate.scalar("x", 2.0, high=1)
    with pytest.raises(TypeError, match="x: expected a number, got bool"):
        validate.scalar("x", True)
    assert validate.scalar("x", -INF, finite=False) == -INF
