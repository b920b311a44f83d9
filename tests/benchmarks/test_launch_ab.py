"""`benchmarks/tools/launch_ab.py`'s handling of the setting it compares (the timing itself needs a GPU)."""
import argparse

import pytest

from benchmarks.tools import launch_ab
from cat_fast.kernels.triton import residual_layer_norm as rln


def test_setting_is_found_and_restored():
    launch, key = launch_ab._launch("residual_layer_norm.params_prefetch")
    assert launch is rln.LAUNCH and key == "params_prefetch"
    before = rln.LAUNCH["params_prefetch"]
    with launch_ab._set([(launch, key)], (0,)):
        assert rln.LAUNCH["params_prefetch"] == 0
    assert rln.LAUNCH["params_prefetch"] == before
    with pytest.raises(RuntimeError), launch_ab._set([(launch, key)], (0,)):
        raise RuntimeError("a step failed")
    assert rln.LAUNCH["params_prefetch"] == before


def test_a_module_level_switch_is_found_and_restored():
    from cat_fast.layers import packing
    holder, key = launch_ab._launch("layers.packing.VARLEN")
    assert key == "VARLEN" and holder is vars(packing)
    before = packing.VARLEN
    with launch_ab._set([(holder, key)], (not before,)):
        assert packing.VARLEN is (not before)
    assert packing.VARLEN is before


def test_a_switch_of_the_suite_is_found_and_restored():
    from benchmarks.steps import harness
    holder, key = launch_ab._launch("harness.HOST_BATCHES")
    assert key == "HOST_BATCHES" and holder is vars(harness)
    with launch_ab._set([(holder, key)], (False,)):
        assert harness.HOST_BATCHES is False
    assert harness.HOST_BATCHES is True


@pytest.mark.parametrize("setting, names", [("no_such_module.rows", "no_such_module"),
                                            ("harness.NO_SUCH", "benchmarks.steps.harness has no module-level"),
                                            ("residual_layer_norm.no_such_key", "no_such_key"),
                                            ("layers.training.forward", "forward"),
                                            ("layers.training.NO_SUCH", "NO_SUCH"),
                                            ("VARLEN", "module.key")])
def test_unknown_setting_names_what_is_missing(setting, names):
    with pytest.raises(SystemExit, match=names):
        launch_ab._launch(setting)


def test_several_settings_are_set_and_restored_together():
    from cat_fast.kernels.triton import gelu_bias_backward as gelu
    settings = [launch_ab._launch(f"gelu_bias_backward.{key}") for key in ("block_m", "tile_sums")]
    before = dict(gelu.LAUNCH)
    values = launch_ab._values("8,false", 2)
    assert values == (8, False)
    with pytest.raises(RuntimeError), launch_ab._set(settings, values):
        assert gelu.LAUNCH["block_m"] == 8 and gelu.LAUNCH["tile_sums"] is False
        raise RuntimeError("a step failed")
    assert gelu.LAUNCH == before
    with pytest.raises(SystemExit, match="2 comma-separated"):
        launch_ab._values("8", 2)
    with pytest.raises(SystemExit, match="'fast'"):
        launch_ab._values("8,fast", 2)


def test_values_parse_as_launch_entries():
    assert [launch_ab._value(v) for v in ("1", "0", "0.5", "None", "none", "true", "False", "str:flash", "str:")] == [
        1, 0, 0.5, None, None, True, False, "flash", ""]
    with pytest.raises(argparse.ArgumentTypeError, match="'fast'"):
        launch_ab._value("fast")


def test_each_size_runs_in_a_process_of_its_own(tmp_path):
    from benchmarks.tools import each_size_apart

    log = tmp_path / "calls.txt"
    script = tmp_path / "tool.py"
    script.write_text("import sys\nopen(sys.argv[-1], 'a').write(' '.join(sys.argv[1:-1]) + '\\n')\n"
                      "sys.exit(3 if sys.argv[1] == '9x9' else 0)\n")
    assert not each_size_apart(str(script), ["8x128"], ["8x128", "--rounds", "2", str(log)])
    assert not log.exists()  # one size: the caller runs it
    argv = ["8x128", "32x128", "--setting", "layers.packing.VARLEN", "--values", "false", "true", str(log)]
    assert each_size_apart(str(script), ["8x128", "32x128"], argv)
    assert log.read_text().splitlines() == ["8x128 --setting layers.packing.VARLEN --values false true",
                                            "32x128 --setting layers.packing.VARLEN --values false true"]
    with pytest.raises(SystemExit, match="tool.py: the run at 9x9 failed"):
        each_size_apart(str(script), ["8x128", "9x9", "64x256"], ["8x128", "9x9", "64x256", str(log)])
    assert log.read_text().splitlines()[-2:] == ["8x128", "9x9"]  # stopped at the failing size


def test_cat_layers_need_a_cat_method(monkeypatch, capsys):
    import sys
    monkeypatch.setattr(sys, "argv", ["launch_ab.py", "8x128", "--setting", "layers.packing.NARROW", "--values",
                                      "false", "true", "--cat-layers", "9"])
    with pytest.raises(SystemExit):
        launch_ab.main()
    assert "--cat-layers: expected a CAT method" in capsys.readouterr().err
