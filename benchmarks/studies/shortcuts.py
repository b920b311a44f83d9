"""The planted-shortcut study (docs/RESULTS-shortcuts.md): train every (method, seed) on a dataset written by
`cat-fast shortcut plant`, score the anti-correlated and the cue-free test sets, and tabulate them.

    python benchmarks/studies/shortcuts.py DIR --methods erm poe reweight --seeds 0 1 2 --root runs/shortcuts/NAME
    python benchmarks/studies/shortcuts.py DIR --root runs/shortcuts/NAME --report docs/shortcuts/NAME.md

Each run is ``cat-fast train --train DIR/train.jsonl --dev DIR/dev.jsonl --eval anti=DIR/test_anti.jsonl
clean=DIR/test_clean.jsonl`` into ROOT/METHOD/seedN; the ``ceiling`` runs (ERM on DIR/train_clean.jsonl, the same
rows without the cue) into ROOT/ceiling/seedN. The bias-model methods (:data:`BIAS_METHODS`) get ``--bias
ROOT/bias``, fitted first on the ``cue`` column (:data:`BIAS_FIT`); conf-reg's teacher is the ERM run of its seed.
``mask`` and ``mask-random`` (:data:`MASK_METHODS`) are the masking route (`mask_jobs`).
A method may carry its own options (``clp:virtual_lr=1e-2,clp_scale=3``: its folder is
``clp+virtual_lr=1e-2+clp_scale=3``); CLP (:data:`META_METHODS`) gets ``--meta-data ROOT/meta.jsonl``, a
cue-balanced draw of at most :data:`META_ROWS` dev rows (`write_meta`), and its diagnostics by ``cue``.
Runs go ``--jobs-per-gpu`` at a time on each visible GPU (``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``; none:
one at a time on the CPU), each with its own ``CUDA_VISIBLE_DEVICES`` and log in ROOT/logs; a run whose
metrics.json exists is skipped. ``--report`` trains nothing: it writes the markdown table (accuracy in %, mean ±
sample standard deviation over seeds) of every finished run under ROOT.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
from typing import Dict, List, Optional, Sequence

# the bias model of the cue column; its flags live here only
BIAS_FIT = "cat-fast bias fit --kind features --feature-columns cue --folds 5"
BIAS_METHODS = ("poe", "reweight", "reweight-inverse", "learned-mixin", "conf-reg")
TRAIN = "--model minilm --epochs 3 --batch-size 16 --max-length 128 --lr 5e-5 --overwrite"
CEILING = "ceiling"
COLUMNS = (("anti", "anti"), ("clean", "clean"), ("dev", "biased dev"))
# metadata-set methods: --meta-data ROOT/meta.jsonl (`write_meta`: cue-balanced, from dev), diagnostics by cue
META_METHODS = ("clp", "clp-all")
META_ROWS = 100
# the masking route (`mask_jobs`): mediation on the ERM model of the seed with the cue rows of dev as the treatment,
# k chosen on the biased dev set, then the masked model scored; ``mask-random`` masks as many random neurons
# ``unlearn``: gradient unlearning of the chosen k neurons of that analysis (the cue bias model's advantaged rows);
# ``poe+mask``: the paper's combination, the same masking route run on the PoE model of the seed
MASK_METHODS = ("mask", "mask-random", "unlearn", "poe+mask")
MEDIATION = "--per-class 40 --max-length 128"


def split_spec(spec: str):
    """``METHOD[:OPTION=VALUE,...]`` (e.g. ``clp:virtual_lr=1e-2,clp_scale=3``) -> (the run's folder name, the
    method, its extra flags ``--virtual-lr 1e-2 --clp-scale 3``)."""
    method, _, options = spec.partition(":")
    pairs = [o.split("=", 1) for o in options.split(",") if o]
    if any(len(p) != 2 or not p[0] or not p[1] for p in pairs):
        raise SystemExit(f"--methods {spec}: expected METHOD[:OPTION=VALUE,...], e.g. clp:virtual_lr=1e-2")
    flags = "".join(f" --{k.replace('_', '-')} {shlex.quote(v)}" for k, v in pairs)
    name = method + "".join(f"+{k}={v}" for k, v in pairs)
    return name, method, flags


def write_meta(data: str, root: str, rows: int = META_ROWS) -> str:
    """ROOT/meta.jsonl: a cue-balanced metadata set from DIR/dev.jsonl — the same number of rows (at most
    rows / cells) of every (label, cue) cell, drawn with a fixed seed; written once."""
    import random

    path = os.path.join(root, "meta.jsonl")
    if os.path.isfile(path):
        return path
    cells: Dict = {}
    with open(os.path.join(data, "dev.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            cells.setdefault((row["label"], row["cue"]), []).append(line)
    n = min([len(v) for v in cells.values()] + [rows // max(1, len(cells))])
    drawn = [line for key in sorted(cells, key=str) for line in random.Random(0).sample(cells[key], n)]
    os.makedirs(root, exist_ok=True)
    with open(path, "w") as f:
        f.writelines(drawn)
    return path


class Job:
    """One command line: ``name`` (its log), ``out`` (done when ``done`` exists there), ``phase`` (0 before 1)."""

    def __init__(self, name: str, command: str, out: str, done: str, phase: int):
        self.name, self.command, self.out, self.done, self.phase = name, command, out, done, phase

    @property
    def finished(self) -> bool:
        return os.path.isfile(os.path.join(self.out, self.done))


def data_flags(data: str) -> str:
    """The column options of the planted files (shortcut.json: labels in id order, text pairs, groups)."""
    with open(os.path.join(data, "shortcut.json")) as f:
        meta = json.load(f)
    pair = " --text-pair-column text_pair" if meta.get("pairs") else ""
    group = " --group-column group" if meta.get("groups") else ""
    return (f"--text-column text{pair} --label-column label{group} --id-column id "
            f"--labels {','.join(meta['labels'])}")


def plan(data: str, methods: Sequence[str], seeds: Sequence[int], root: str, train_flags: str = TRAIN,
         ceiling: bool = True, bias_fit: str = BIAS_FIT) -> List[Job]:
    """Every job of the study, finished or not: the bias fit (if a bias method runs), ERM and the ceiling (phase
    0), then the other methods (phase 1: they may read the bias file or an ERM teacher)."""
    cols = data_flags(data)
    jobs = []
    masking = [m for m in methods if m in MASK_METHODS]
    methods = [m for m in methods if m not in MASK_METHODS]
    evals = f"--dev {data}/dev.jsonl --eval anti={data}/test_anti.jsonl clean={data}/test_clean.jsonl"
    teacher = "conf-reg" in methods or bool(masking)
    if teacher and "erm" not in methods:
        methods = ["erm"] + list(methods)
    if "poe+mask" in masking and "poe" not in methods:
        methods = list(methods) + ["poe"]
    if "unlearn" in masking or any(split_spec(m)[1] in BIAS_METHODS for m in methods):
        out = f"{root}/bias"
        jobs.append(Job("bias", f"{bias_fit} --train {data}/train.jsonl {cols} --out {out} --overwrite", out,
                        "bias.jsonl", 0))
    kept = {"erm"} | ({"poe"} if "poe+mask" in masking else set())
    for seed in seeds:  # seeds outermost: a study cut short keeps the same seeds for every method
        runs = [(CEILING, "erm", "", "train_clean")] if ceiling else []
        runs += [(*split_spec(m), "train") for m in methods]
        for name, method, flags, train in runs:
            out = f"{root}/{name}/seed{seed}"
            extra = ("" if teacher and name in kept else " --no-checkpoint") + flags
            if method in META_METHODS:
                extra += f" --meta-data {root}/meta.jsonl --diagnose-column cue"
            if method in BIAS_METHODS:
                extra += f" --bias {root}/bias"
            if method == "conf-reg":
                extra += f" --teacher {root}/erm/seed{seed}"
            command = (f"cat-fast train --method {method} --train {data}/{train}.jsonl {evals} {cols} {train_flags} "
                       f"--seed {seed}{extra} --out {out}")
            jobs.append(Job(f"{name}-seed{seed}", command, out, "metrics.json", 0 if method == "erm" else 1))
        jobs += mask_jobs(data, cols, root, seed, masking, evals)
    return jobs


def _masking(data, cols, root, seed, model, name, scores, phase) -> Job:
    """Mediation of `model` with dev's cue rows as the treatment, ``mask --select-k`` on the biased dev set, the
    masked model scored into ROOT/NAME/seedN (its analysis and model in ROOT/NAME-work/seedN)."""
    with open(os.path.join(data, "shortcut.json")) as f:
        cue_class = json.load(f)["cue_class"]
    work = f"{root}/{name}-work/seed{seed}"
    return Job(f"{name}-seed{seed}", f"cat-fast mediation --model {model} --samples {data}/dev.jsonl {cols} "
               f"--treatment-where cue=1 --target-class {shlex.quote(cue_class)} {MEDIATION} --seed {seed} "
               f"--out {work}/nie --overwrite ;; cat-fast mask --model {model} --nie {work}/nie --select-k "
               f"--select-dev {data}/dev.jsonl {cols} --out {work}/model --overwrite ;; cat-fast eval --model "
               f"{work}/model {scores} --out {root}/{name}/seed{seed} --overwrite", f"{root}/{name}/seed{seed}",
               "metrics.json", phase)


def mask_jobs(data: str, cols: str, root: str, seed: int, masking: Sequence[str], evals: str) -> List[Job]:
    """The masking route of one seed: ``mask`` (phase 1: `_masking` of the ERM model), then (phase 2) ``mask-random``
    (the chosen k, random neurons), ``unlearn`` (the chosen k unlearned on the ERM model) and ``poe+mask``
    (`_masking` of the PoE model)."""
    if not masking:
        return []
    erm, work = f"{root}/erm/seed{seed}", f"{root}/mask-work/seed{seed}"
    scores = evals.replace("--dev ", "--eval dev=").replace(" --eval anti=", " anti=")
    jobs = [_masking(data, cols, root, seed, erm, "mask", scores, 1)]
    if "poe+mask" in masking:
        jobs.append(_masking(data, cols, root, seed, f"{root}/poe/seed{seed}", "poe+mask", scores, 2))
    if "unlearn" in masking:
        jobs.append(Job(f"unlearn-seed{seed}", f"cat-fast unlearn --model {erm} --nie {work}/nie --train "
                        f"{data}/train.jsonl {cols} --bias {root}/bias --top-k {{chosen_k:{work}/model/"
                        f"k_selection.json}} --seed {seed} --out {work}/unlearn --overwrite ;; cat-fast eval --model "
                        f"{work}/unlearn {scores} --out {root}/unlearn/seed{seed} --overwrite",
                        f"{root}/unlearn/seed{seed}", "metrics.json", 2))
    if "mask-random" in masking:
        jobs.append(Job(f"mask-random-seed{seed}", f"cat-fast mask --model {erm} --nie {work}/nie --random-neurons "
                        f"--top-k {{chosen_k:{work}/model/k_selection.json}} --seed {seed} --out {work}/random "
                        f"--overwrite ;; cat-fast eval --model {work}/random {scores} --out "
                        f"{root}/mask-random/seed{seed} --overwrite", f"{root}/mask-random/seed{seed}",
                        "metrics.json", 2))
    return jobs


def resolve(command: str) -> str:
    """``{chosen_k:FILE}`` in a command -> the k that FILE (a ``k_selection.json``) chose (at least 1)."""
    import re

    def chosen(match):
        with open(match.group(1)) as f:
            return str(max(1, int(json.load(f)["chosen_k"])))

    return re.sub(r"\{chosen_k:([^}]+)\}", chosen, command)


def visible_gpus() -> List[str]:
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return [g for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [str(i) for i, line in enumerate(listed.splitlines()) if line.startswith("GPU")]


def run_jobs(jobs: Sequence[Job], gpus: Sequence[str], per_gpu: int, logs: str) -> Dict[str, int]:
    """Run the unfinished `jobs`, phase by phase, `per_gpu` at a time on each of `gpus` (none: one on the CPU);
    returns each run job's exit status."""
    os.makedirs(logs, exist_ok=True)
    slots = [g for g in gpus for _ in range(per_gpu)] or [None]
    status: Dict[str, int] = {}
    for phase in sorted({j.phase for j in jobs}):
        todo = [j for j in jobs if j.phase == phase and not j.finished]
        lock = threading.Lock()

        def worker(gpu: Optional[str]):
            while True:
                with lock:
                    if not todo:
                        return
                    job = todo.pop(0)
                env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
                if gpu is not None:
                    env["CUDA_VISIBLE_DEVICES"] = gpu
                with open(os.path.join(logs, f"{job.name}.log"), "w") as log:
                    code = 0
                    for part in job.command.split(" ;; "):  # a pipeline: each command after the last succeeded
                        try:
                            part = resolve(part)
                        except (OSError, KeyError, ValueError) as error:
                            log.write(f"{part}\n{error}\n")
                            code = 1
                            break
                        log.write(part + "\n")
                        log.flush()
                        argv = [sys.executable, "-m", "cat_fast.cli"] + shlex.split(part)[1:]
                        code = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
                        if code:
                            break
                    status[job.name] = code
                print(f"{job.name}: exit {status[job.name]} (gpu {gpu if gpu is not None else 'none'})", flush=True)

        threads = [threading.Thread(target=worker, args=(g,)) for g in slots]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return status


def collect(root: str) -> Dict[str, Dict[int, Dict]]:
    """``{method: {seed: metrics["eval"]}}`` of every finished run under `root` (ROOT/METHOD/seedN/metrics.json)."""
    out: Dict[str, Dict[int, Dict]] = {}
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        for run in sorted(os.listdir(os.path.join(root, name))) if os.path.isdir(os.path.join(root, name)) else []:
            path = os.path.join(root, name, run, "metrics.json")
            if run.startswith("seed") and run[4:].isdigit() and os.path.isfile(path):
                with open(path) as f:
                    out.setdefault(name, {})[int(run[4:])] = json.load(f).get("eval", {})
    return out


def fmt(values: Sequence[float]) -> str:
    if not values:
        return "—"
    mean = 100 * statistics.mean(values)
    sd = 100 * statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.1f} ± {sd:.1f}"


def report(root: str, data: Optional[str] = None, methods: Sequence[str] = ()) -> str:
    """The markdown table: one row per method (`methods` first, in order, then any other finished ones; the
    ceiling last), accuracy on test_anti, test_clean and the biased dev set, and the clean − anti gap."""
    runs = collect(root)
    methods = [split_spec(m)[0] for m in methods]
    order = [m for m in methods if m in runs] + sorted(m for m in runs if m not in methods and m != CEILING)
    order += [CEILING] if CEILING in runs else []
    lines = []
    if data and os.path.isfile(os.path.join(data, "shortcut.json")):
        with open(os.path.join(data, "shortcut.json")) as f:
            meta = json.load(f)
        lines += [f"Cue `{meta['cue']}` in {meta['field']}, strength {meta['strength']}, predicting "
                  f"`{meta['cue_class']}` (seed {meta['seed']}).", ""]
    lines += ["| method | seeds | " + " | ".join(title for _, title in COLUMNS) + " | clean − anti |",
              "| --- | --- | " + " | ".join("---" for _ in COLUMNS) + " | --- |"]
    for method in order:
        evals = runs[method]
        cells = [fmt([e[key]["accuracy"] for e in evals.values() if key in e]) for key, _ in COLUMNS]
        gap = fmt([e["clean"]["accuracy"] - e["anti"]["accuracy"] for e in evals.values()
                   if "clean" in e and "anti" in e])
        label = "ceiling (ERM, no cue)" if method == CEILING else method
        lines.append(f"| {label} | {len(evals)} | " + " | ".join(cells) + f" | {gap} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", metavar="DIR", help="the planted dataset (cat-fast shortcut plant --out DIR)")
    p.add_argument("--methods", nargs="+", default=["erm"], help="cat-fast train --method names, each with "
                   "options as METHOD:OPTION=VALUE,... (e.g. clp:virtual_lr=1e-2,clp_scale=3; run folder "
                   "METHOD+OPTION=VALUE...)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--root", required=True, help="where the runs go (ROOT/METHOD/seedN)")
    p.add_argument("--no-ceiling", action="store_true", help="leave out the ERM runs on train_clean.jsonl")
    p.add_argument("--train-flags", default=TRAIN, help="the flags every cat-fast train run shares")
    p.add_argument("--bias-fit", default=BIAS_FIT, help="the bias model's command (e.g. an unknown bias: cat-fast "
                   "bias fit --kind weak-learner --folds 5 ...); --train, the columns and --out are added")
    p.add_argument("--jobs-per-gpu", type=int, default=1, help="runs at once on each GPU")
    p.add_argument("--dry-run", action="store_true", help="print the commands of the unfinished jobs")
    p.add_argument("--report", metavar="FILE", help="write the table of the finished runs to FILE ('-': stdout)")
    args = p.parse_args(argv)
    if args.report:
        table = report(args.root, args.data, args.methods)
        if args.report == "-":
            sys.stdout.write(table)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
            with open(args.report, "w") as f:
                f.write(table)
        return 0
    jobs = plan(args.data, args.methods, args.seeds, args.root, args.train_flags, ceiling=not args.no_ceiling,
                bias_fit=args.bias_fit)
    todo = [j for j in jobs if not j.finished]
    print(f"{len(jobs) - len(todo)} of {len(jobs)} jobs finished already", flush=True)
    if args.dry_run:
        for job in todo:
            print(job.command)
        return 0
    if any(split_spec(m)[1] in META_METHODS for m in args.methods):
        write_meta(args.data, args.root)
    status = run_jobs(todo, visible_gpus(), max(1, args.jobs_per_gpu), os.path.join(args.root, "logs"))
    failed = sorted(name for name, code in status.items() if code)
    if failed:
        print(f"failed ({len(failed)}; logs in {args.root}/logs): {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
