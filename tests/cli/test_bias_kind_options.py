"""Each `cat-fast bias fit --kind` declares its options once (cat_fast.cli.bias_kinds): for every declared kind and
option, the parser takes it with that kind (in the group titled by the kinds that declare it), `fit` refuses it with
every other kind (one line naming it and its kinds, exit 2, nothing written), a needed option not given is refused,
and each option not given reaches the fitter as its kind declares it (the weak learner's as the library's defaults)."""
import dataclasses
import inspect

import pytest

from cat_fast import cli
from cat_fast.cli import bias as bias_cli
from cat_fast.cli.bias_kinds import BIAS_KINDS, KINDS, kind_options, resolve_kind_options
from cat_fast.cli.common import CliError

from .conftest import run, write_csv

OPTIONS = kind_options()
OWN = ["--text-column", "text", "--label-column", "label"]


def sample(opt):
    """A value the option's type takes."""
    if "choices" in opt.argparse:
        return opt.argparse["choices"][-1]
    convert = opt.argparse.get("type", str)
    for text in ("2", "0.5", "cue"):
        try:
            convert(text)
            return text
        except Exception:
            continue
    raise AssertionError(f"no sample value for {opt.flag}")


def needed(kind):
    """The argv of the options `kind` needs."""
    return [x for o in kind.options if o.needs for x in (o.flag, sample(o))]


def data(tmp_path):
    rows = [{"text": f"w{i} w{i % 3}", "label": ("pos", "neg")[i % 2], "cue": "xy"[i % 3 == 0]} for i in range(12)]
    return write_csv(tmp_path / "t.csv", rows)


OWN_CASES = [(k, o) for k in BIAS_KINDS for o in k.options]
OTHER_CASES = [(k, flag) for k in BIAS_KINDS for flag, by_kind in OPTIONS.items() if k.name not in by_kind]


def test_the_kinds_are_the_declarations():
    fit = cli.build_parser()._subparsers._group_actions[0].choices["bias"]._subparsers._group_actions[0] \
        .choices["fit"]
    kind = next(a for a in fit._actions if a.dest == "kind")
    assert tuple(kind.choices) == KINDS == tuple(k.name for k in BIAS_KINDS)
    assert all(f"{k.name}: {k.help}" in kind.help for k in BIAS_KINDS)
    assert set(bias_cli.FITTERS) == set(KINDS)
    titles = {a.option_strings[0]: g.title for g in fit._action_groups for a in g._group_actions if a.option_strings}
    for flag, by_kind in OPTIONS.items():
        assert titles[flag] == "--kind " + " and ".join(by_kind), flag
    shared = {flag for flag, by_kind in OPTIONS.items() if len(by_kind) > 1}
    assert {"--model", "--batch-size", "--C"} <= shared


@pytest.mark.parametrize("kind, opt", OWN_CASES, ids=[f"{k.name} {o.flag}" for k, o in OWN_CASES])
def test_each_kind_takes_its_options(kind, opt):
    argv = ["bias", "fit", "--kind", kind.name, "--out", "o", *needed(kind)]
    if not opt.needs:
        argv += [opt.flag, sample(opt)]
    args = cli.build_parser().parse_args(argv)
    assert resolve_kind_options(args) is kind
    assert opt.dest in args.kind_options_given
    assert getattr(args, opt.dest) == opt.argparse.get("type", str)(sample(opt))


@pytest.mark.parametrize("kind, flag", OTHER_CASES, ids=[f"{k.name} {f}" for k, f in OTHER_CASES])
def test_another_kinds_option_is_refused(tmp_path, capsys, kind, flag):
    by_kind = OPTIONS[flag]
    out = tmp_path / "b"
    code, err = run(["bias", "fit", "--kind", kind.name, "--train", data(tmp_path), *OWN, "--out", out,
                     *needed(kind), flag, sample(next(iter(by_kind.values())))], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    assert lines[0] == f"cat-fast: error: {flag} is for --kind {' and '.join(by_kind)}, not {kind.name}"
    assert not out.exists()


NEEDS = [(k, o) for k in BIAS_KINDS for o in k.options if o.needs]


@pytest.mark.parametrize("kind, opt", NEEDS, ids=[f"{k.name} {o.flag}" for k, o in NEEDS])
def test_a_needed_option_not_given_is_refused(tmp_path, capsys, kind, opt):
    out = tmp_path / "b"
    code, err = run(["bias", "fit", "--kind", kind.name, "--train", data(tmp_path), *OWN, "--out", out], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    assert lines[0].startswith(f"cat-fast: error: --kind {kind.name} needs {opt.flag} ") and opt.needs in lines[0]
    assert not out.exists()


def reached(monkeypatch, tmp_path, capsys, kind, *extra):
    """The namespace `kind`'s fitter is called with (the fitter replaced by a spy that stops the run)."""
    seen = {}

    def spy(args, train):
        seen["args"] = args
        raise CliError("spied")

    def resolve(args):
        return dataclasses.replace(resolve_kind_options(args), fit=spy)

    monkeypatch.setattr(bias_cli, "resolve_kind_options", resolve)
    code, err = run(["bias", "fit", "--kind", kind.name, "--train", data(tmp_path), *OWN, "--out", tmp_path / "b",
                     *needed(kind), *extra], capsys)
    assert code == 2 and "spied" in err, err
    return seen["args"]


@pytest.mark.parametrize("kind", BIAS_KINDS, ids=KINDS)
def test_the_defaults_reach_the_fitter(monkeypatch, tmp_path, capsys, kind):
    args = reached(monkeypatch, tmp_path, capsys, kind)
    for flag, by_kind in OPTIONS.items():
        opt = by_kind.get(kind.name)
        dest = next(iter(by_kind.values())).dest
        if opt is None:
            assert getattr(args, dest) is None, flag
        elif not opt.needs:
            assert getattr(args, dest) == opt.default, flag
    assert args.kind_options_given == {o.dest for o in kind.options if o.needs}


def test_a_given_option_reaches_the_fitter_over_its_default(monkeypatch, tmp_path, capsys):
    weak = BIAS_KINDS[KINDS.index("weak-learner")]
    args = reached(monkeypatch, tmp_path, capsys, weak, "--gce-q", "0.25", "--max-length", "16")
    assert (args.gce_q, args.max_length, args.subset, args.weak_loss) == (0.25, 16, 2000, "gce")


def test_the_weak_learners_defaults_are_the_librarys():
    from cat_fast.bias import WeakLearner

    library = {name: p.default for name, p in inspect.signature(WeakLearner.__init__).parameters.items()}
    declared = {o.dest: o.default for o in BIAS_KINDS[KINDS.index("weak-learner")].options}
    declared["loss"] = declared.pop("weak_loss")
    assert declared == {k: library[k] for k in declared}
    assert (declared["loss"], declared["gce_q"], declared["subset"], declared["epochs"], declared["lr"],
            declared["max_length"]) == ("gce", 0.7, 2000, 3, 5e-5, 128)


def test_one_flag_declared_with_other_argparse_keywords_is_refused(monkeypatch):
    from cat_fast.cli import bias_kinds

    first = bias_kinds.BIAS_KINDS[0]
    clash = dataclasses.replace(first, options=first.options + (bias_kinds.option("--subset", type=int),))
    monkeypatch.setattr(bias_kinds, "BIAS_KINDS", (clash,) + bias_kinds.BIAS_KINDS[1:])
    with pytest.raises(TypeError, match="--subset"):
        bias_kinds.kind_options()
