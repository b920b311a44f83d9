"""``cat-fast train``'s data: the training, dev and evaluation sets, the batch stream, and what the objective
requires of them, provided by one handler per requirement kind (`HANDLERS`, keyed by
`cat_fast.objectives.Requirement.kind`, never by method): counterfactual pairs, a bias file (``bias`` column),
a teacher (``teacher_probs`` column), a metadata set (``meta_batches``). Each handler adds its flags to the parser,
reads its files before the model loads and provides its columns and arguments after."""
from __future__ import annotations

import sys
from typing import Dict, List

from .common import CliError

__all__ = ["HANDLERS", "Prepared", "dev_half", "read_train", "read_dev", "stream_parts", "methods_requiring",
           "add_requirement_options", "DEV_SPLIT_SEED"]

DEV_SPLIT_SEED = 20261127  # fixed: the same two halves for every run, whatever --seed


def dev_half(dev, half: str):
    """Half of `dev` by counterfactual group (an original and its edits stay together): ``"tune"`` or ``"report"``,
    the groups shuffled with a fixed seed and cut in two, so that hyper-parameters chosen on one half are scored on
    the other (the equal tuning budget of docs/RESULTS-quality.md)."""
    import random

    groups = sorted(set(dev.group), key=str)
    random.Random(DEV_SPLIT_SEED).shuffle(groups)
    chosen = set(groups[: len(groups) // 2] if half == "tune" else groups[len(groups) // 2:])
    return dev.subset([i for i, g in enumerate(dev.group) if g in chosen])


def report_skipped(name: str, data) -> None:
    skipped = getattr(data, "skipped", 0)
    if skipped:
        where = ", ".join(getattr(data, "skipped_where", [])[:3])
        sys.stderr.write(f"cat-fast: warning: {name}: skipped {skipped} row(s) with empty text ({where})\n")


class Prepared:
    """The run's data as the phases fill it in: the sets, and what the requirements provide — batch columns
    (``rows``: column -> a tensor indexed by example) and constructor arguments (``kwargs``)."""

    def __init__(self, args, entry, source):
        self.args, self.entry, self.source, self.method = args, entry, source, args.method
        self.kinds = {r.kind for r in entry.cls.requires if not r.optional}
        self.use_pairs = "pairs" in self.kinds  # whole counterfactual groups per batch, a partner chosen per epoch
        self.data_mode = args.data or entry.data
        self.rows: Dict = {}
        self.kwargs: Dict = {}
        self.shift: Dict = {}
        self.record: Dict = {}  # what the requirements add to metrics.json's config
        self.meta_data = self.dev_data = self.device = None
        self.eval_data: List = []


def methods_requiring(kind: str) -> List[str]:
    from .. import objectives

    return [n for n in objectives.names()  # an optional requirement counts: its flags are for its methods too
            if any(r.kind == kind for r in objectives.get(n).cls.requires)]


class Handler:
    """Provides one requirement kind: its flags (``flags``: (dest, flag) given for it, refused for a method without
    the requirement), `read` before the model loads, `provide` after."""

    kind, title, flags = "", "", ()

    def add_arguments(self, group) -> None:
        pass

    def unused(self, run) -> None:
        for dest, flag in self.flags:
            if getattr(run.args, dest, None):
                raise CliError(f"{flag} is for --method {' / '.join(methods_requiring(self.kind))}, not {run.method}")

    def read(self, run) -> None:
        pass

    def provide(self, run, model, tokenizer) -> None:
        pass


class Pairs(Handler):
    kind, title = "pairs", "counterfactual pairs"

    def read(self, run):
        if not run.train_data.has_pairs:
            why = ("--data orig drops the edits" if run.data_mode == "orig" else
                   "give --group-column for your own files; for CAD use a paired sentiment file (with batch_id) or "
                   "NLI revised files after the originals")
            raise CliError(f"--method {run.method} needs counterfactual pairs in the training data, found none ({why})")


class Bias(Handler):
    kind, title, flags = "bias", "bias-model methods", (("bias", "--bias"),)

    def add_arguments(self, group):
        group.add_argument("--bias", metavar="FILE", help="the bias model's predictions for the training examples "
                           "(written by `cat-fast bias fit`; rows matched by example id)")

    def read(self, run):
        args = run.args
        if not args.bias:
            raise CliError(f"--method {run.method} needs --bias FILE: a bias model's predictions for the training "
                           "examples (write them with `cat-fast bias fit`)")
        from ..bias import load_bias

        try:
            from .bias import resolve

            run.rows["bias"] = load_bias(resolve(args.bias), data=run.clean, label_names=list(run.label_names),
                                         extra="ignore")
        except (ValueError, OSError) as error:
            raise CliError(f"--bias {args.bias}: {error}") from error
        _warn_if_certain(run.rows["bias"], run.clean.labels, args.bias)


# the share of training rows on which a bias model may put p(label) >= 0.99 before the run says so
CERTAIN_SHARE = 0.5


def _warn_if_certain(log_probs, labels, path) -> None:
    """A bias model right with p ≥ 0.99 on most training rows leaves a bias-model loss almost no gradient (the main
    model then stays at chance): say so, with the fix, before training."""
    import torch

    p_label = torch.as_tensor(log_probs, dtype=torch.float64).exp().gather(1, torch.as_tensor(labels)[:, None])
    share = float((p_label >= 0.99).double().mean()) if len(labels) else 0.0
    if share > CERTAIN_SHARE:
        sys.stderr.write(f"cat-fast: warning: --bias {path} gives the true label p >= 0.99 on {100 * share:.0f}% of "
                         "the training rows; a bias-model loss then leaves the main model little to learn from. "
                         "Calibrate it (cat-fast bias fit --folds K --calibrate temperature) or make it weaker\n")


class Teacher(Handler):
    kind, title, flags = "teacher", "teacher methods", (("teacher", "--teacher"),)

    def add_arguments(self, group):
        group.add_argument("--teacher", metavar="DIR", help="a trained classifier whose probabilities are the targets")

    def read(self, run):
        if not run.args.teacher:
            raise CliError(f"--method {run.method} needs --teacher DIR: a classifier trained on the same labels (e.g. "
                           "by `cat-fast train --method erm`) whose probabilities are the targets")

    def provide(self, run, model, tokenizer):
        from .. import data as D
        from ..models.pretrained import load_classifier
        from .scoring import predict_probs

        args = run.args
        teacher, _ = load_classifier(args.teacher, None)
        names = tuple(teacher.config.id2label[i] for i in range(teacher.config.num_labels))
        if names != tuple(run.label_names):
            raise CliError(f"--teacher {args.teacher}: its labels {list(names)} are not the data's "
                           f"{list(run.label_names)}")
        tokenized = D.TokenizedData(run.train_data, tokenizer, args.max_length)
        run.rows["teacher_probs"] = predict_probs(teacher.to(run.device), tokenized, args.eval_batch_size,
                                                  run.device, args.bf16)


class Metadata(Handler):
    kind, title, flags = "metadata", "metadata-set methods", (("meta_data", "--meta-data"),)

    def add_arguments(self, m):
        from .common import positive_int

        m.add_argument("--meta-data", metavar="FILE", help="the metadata set (your own file, read with the column "
                       "options; default with a CAD task: a balanced draw from the built-in dev set with its edits, "
                       "which the dev score then leaves out)")
        m.add_argument("--meta-per-class", type=positive_int, default=10, help="originals per class drawn (with "
                       "their edits) for the built-in metadata")
        m.add_argument("--meta-holdout", action="store_true", help="any method: score dev without the groups of the "
                       "built-in metadata draw (--meta-per-class, --seed), as the metadata-set methods do, so that "
                       "the two compare on one set")
        m.add_argument("--meta-batch-size", type=positive_int, default=32, help="metadata examples per meta step")

    def read(self, run):
        if run.args.meta_data:
            run.meta_data = run.source.read(run.args.meta_data, labels=run.label_names)
        else:
            run.meta_data = self._draw(run, needed=True)
        self._record(run)

    def unused(self, run):
        super().unused(run)
        if run.args.meta_holdout:  # the built-in draw's groups leave the dev score all the same
            self._draw(run, needed=False)
            self._record(run)

    def _draw(self, run, needed: bool):
        from .. import data as D
        from ..data import metadata_from_cad

        if run.dev_data is None or not run.dev_data.has_pairs:
            raise CliError(f"--method {run.method} needs --meta-data FILE (a small balanced set; the built-in draw "
                           "needs a CAD dev set with edits)" if needed else
                           "--meta-holdout needs the built-in CAD dev set (with edits)")
        try:
            drawn, run.dev_data = metadata_from_cad(run.dev_data, run.args.meta_per_class, seed=run.args.seed)
        except D.DataError as error:
            raise CliError(f"--meta-per-class {run.args.meta_per_class}: {error}") from error
        return drawn

    def _record(self, run):
        run.record["meta_examples"] = None if run.meta_data is None else len(run.meta_data)
        run.record["dev_examples"] = None  # filled in once --dev-split has cut the dev set (`read_dev`)

    def provide(self, run, model, tokenizer):
        import torch

        from .scoring import encode_batches

        args, meta = run.args, run.meta_data
        order = torch.randperm(len(meta), generator=torch.Generator().manual_seed(args.seed)).tolist()
        counts = torch.bincount(torch.tensor(run.train_data.labels), minlength=len(run.label_names))
        run.kwargs.update(meta_batches=encode_batches(tokenizer, meta, order, args.meta_batch_size, args.max_length,
                                                      run.device),
                          class_prior=counts.tolist(), epoch_size=len(run.train_data))


class DiagnosticGroups(Handler):
    """An optional requirement: a column of the training file as a group id per example (``diagnostic_group``)
    and the group names (``group_names``), for objectives that break their diagnostics down by group."""

    kind, title, flags = "groups", "per-group diagnostics", (("diagnose_column", "--diagnose-column"),)

    def add_arguments(self, group):
        group.add_argument("--diagnose-column", "--clp-diagnose-column", metavar="COLUMN", dest="diagnose_column",
                           help="a column of the training file (e.g. a planted cue) whose values the objective's "
                           "per-epoch diagnostics (metrics.json history) are broken down by")

    def unused(self, run):
        if not any(r.kind == self.kind for r in run.entry.cls.requires):
            return super().unused(run)  # the flag refused for a method without the requirement
        if not run.args.diagnose_column:
            return
        import torch

        from ..bias.feature_columns import FeatureColumnError, read_feature_columns

        column = run.args.diagnose_column
        try:
            values = [str(v) for v in read_feature_columns(run.train_data, [column])[column]]
        except FeatureColumnError as error:
            raise CliError(f"--diagnose-column {column}: {error}") from error
        names = sorted(set(values))
        index = {v: i for i, v in enumerate(names)}
        run.rows["diagnostic_group"] = torch.tensor([index[v] for v in values])
        run.kwargs["group_names"] = [f"{column}={v}" for v in names]


HANDLERS = {h.kind: h for h in (Pairs(), Bias(), Teacher(), Metadata(), DiagnosticGroups())}  # kind -> its provider


def add_requirement_options(parser) -> None:
    """One group of flags per requirement kind that has flags, headed by the methods that require it."""
    for handler in HANDLERS.values():
        group = parser.add_argument_group(f"{handler.title} ({', '.join(methods_requiring(handler.kind))})")
        handler.add_arguments(group)


def read_train(run) -> None:
    """The training data of ``--train`` / the task, with ``--per-class``, ``--data``, ``--long-tail`` and
    ``--label-noise`` applied (`run.clean`: before the label noise, the rows a bias model was fitted on)."""
    from .. import data as D

    args = run.args
    unknown = [r for r in run.entry.cls.requires if not r.optional and r.kind not in HANDLERS]
    if unknown:
        raise CliError(f"--method {run.method} requires {unknown[0].help or unknown[0].kind} (requirement "
                       f"{unknown[0].kind!r}), which cat-fast train does not provide (it provides "
                       f"{', '.join(HANDLERS)}); train it through cat_fast.integrations.ObjectiveTrainer")
    data = run.source.read_train(args.train)
    report_skipped("training data", data)
    if args.per_class:
        data = D.few_shot(data, args.per_class, seed=args.seed, with_edits=(run.data_mode == "orig+edits"))
    elif run.data_mode == "orig":
        data = data.originals()
    try:
        if args.long_tail:
            label, _, fraction = args.long_tail.partition("=")
            try:
                fraction = float(fraction)
            except ValueError:
                raise CliError(f"--long-tail: expected LABEL=FRACTION, got {args.long_tail!r}") from None
            before = len(data)
            data = D.long_tail(data, label, fraction, seed=args.seed)
            run.shift["long_tail"] = {"label": label, "fraction": fraction, "removed": before - len(data)}
        run.clean = data
        if args.label_noise:
            data, flipped = D.with_label_noise(data, args.label_noise, seed=args.seed)
            run.shift["label_noise"] = {"rate": args.label_noise, "flipped": len(flipped)}
    except D.DataError as error:
        raise CliError(str(error)) from error
    run.train_data = data
    if "pairs" in run.kinds:
        HANDLERS["pairs"].read(run)
    run.label_names = run.source.label_names(data)
    D.require_classes(data)  # one class would build a one-label (regression) head


def read_dev(run, evals) -> None:
    """The dev set, the requirements' files (each kind's handler: required, or its flags refused), ``--dev-split``
    and the ``--eval`` sets."""
    args, source = run.args, run.source
    if "bias" in run.kinds:  # before the dev set, as the bias file is checked against the training rows
        HANDLERS["bias"].read(run)
    else:
        HANDLERS["bias"].unused(run)
    run.dev_data = source.read(args.dev, labels=run.label_names) if args.dev else source.builtin_dev()
    for kind, handler in HANDLERS.items():
        if kind not in ("pairs", "bias"):
            (handler.read if kind in run.kinds else handler.unused)(run)
    if args.dev_split != "all":
        if run.dev_data is None:
            raise CliError("--dev-split needs a dev set (the built-in CAD dev set, or --dev FILE)")
        run.dev_data = dev_half(run.dev_data, args.dev_split)
    if "dev_examples" in run.record:
        run.record["dev_examples"] = None if run.dev_data is None else len(run.dev_data)
    if (args.keep_best or args.early_stopping_patience) and run.dev_data is None:
        raise CliError("--keep-best and --early-stopping-patience choose by dev accuracy: they need a dev set (--dev "
                       "FILE, or --task for the built-in one)")
    run.eval_data = [(name, source.read(path, labels=run.label_names)) for name, path in evals]
    for name, d in ([("dev", run.dev_data)] if run.dev_data is not None else []) + run.eval_data:
        report_skipped(name, d)


def stream_parts(tokenized, tokenizer, epoch_batches, partners, rows=None, buckets=None):
    """A dataset, a batch sampler and a collate function over the batches of every epoch in order (keys are
    (epoch, index); the collate function pairs each sample with its counterfactual chosen for that epoch, adds the
    requirements' per-example columns `rows`, and pads each batch to a length of `buckets` when given)."""
    import torch

    from .. import data as D

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return len(tokenized)

        def __getitem__(self, key):
            epoch, i = key
            item = tokenized[i]
            item["epoch"] = epoch
            return item

    class Stream(torch.utils.data.Sampler):
        def __init__(self):
            self.batches = [[(e, i) for i in batch] for e, batches in enumerate(epoch_batches) for batch in batches]

        def __iter__(self):
            return iter(self.batches)

        def __len__(self):
            return len(self.batches)

    collators = {}

    def collate(items):
        epoch = items[0]["epoch"]
        if epoch not in collators:
            collators[epoch] = D.Collator(tokenizer, partner=partners(epoch) if partners else None, buckets=buckets)
        batch = collators[epoch]([{k: v for k, v in it.items() if k != "epoch"} for it in items])
        index = torch.tensor([it["index"] for it in items])
        for name, table in (rows or {}).items():  # the requirements' per-example columns
            batch[name] = table.index_select(0, index)
        return batch

    return Items(), Stream(), collate
