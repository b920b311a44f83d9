"""Sweep of the cmix CUDA tile plans (CAT_FAST_CMIX_PLAN, see csrc/cuda/cmix.cu), kernel-only, on a GPU.

The plan is read once per process, so every plan runs in its own subprocess with
CAT_FAST_CMIX_PLAN="<plan>,verbose=1". Each subprocess first checks the cuda kernels against a float64
computation (kernel_only.check on the tile-path shapes of kernel_only.CHECK_CASES, [64,512,1024] among
them, for float32 / bfloat16 / float16, with the bitwise determinism check of the backward), then times
the forward and the backward at [B,T,D] = [64,512,1024] (per-sample lam, permutation partner, as in
kernel_only.py) for bfloat16 and float32 with kernel_only.time_fwd_bwd (CUDA events, median, L2 evicted
clean before each call), and a 512 MiB device copy timed the same way. Bytes moved: forward 2N (read h,
write out), backward 3N (read grad and h, write grad_h), fwd+bwd 5N (N = size of h); % of copy = achieved GB/s over the copy's GB/s (read + write) measured by
the first (default) plan's process.

The forward and backward knobs are independent (fwd_* only change the forward launch, bwd_* and fill
only the backward), so the built-in plans each pair one forward variant with one backward variant.
At the end: per dtype, the best measured plan by fwd+bwd time, the best forward and best backward
variants, and their union, which is measured too when it is a new plan (--no-combine: not). The
default plan runs first and last (the spread shows the run-to-run noise).

Usage on a GPU (after building the extension: `python setup.py build_ext --inplace`):
    python benchmarks/tools/cmix_sweep.py                    # built-in plans
    python benchmarks/tools/cmix_sweep.py "" "fwd_w=16" "bwd_rows=8,bwd_w=32"   # these plans ("" = default)
Options: --full-check (all kernel_only.CHECK_CASES), --no-check, --no-combine, --budget-s S (default 150:
no new plan starts after S seconds).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPE = (64, 512, 1024)
DTYPES = ("bfloat16", "float32")
RESULT_TAG = "CMIX_SWEEP_RESULT "

# Knobs (csrc/cuda/cmix_plan.cu, "tuning overrides"): fwd_w / bwd_w (1..32, powers of two; B * W <= rows * 256),
# fwd_rows / bwd_rows (2, 4, 8), fwd_packs / bwd_packs (1, 2), bwd_minb (1, 2, 3 where instantiated),
# fwd_bps / bwd_bps (blocks per SM cap), bwd_split, fill, fwd_async / bwd_async (0, 1: cp.async
# double-buffered tiles; rows 4 or 8, packs 1, bwd_minb 2 or 3 at rows 4). Defaults: forward W=32 rows=8 packs=1 (64 x 32-pack
# tiles of 32 KiB, 4 blocks/SM); backward W=16 rows=4 packs=1 minb=2 (2 x 16 KiB tiles, 2 blocks/SM); fill
# 0.75. Each entry pairs a forward variant (left comment) with a backward variant (right); at B=64.
PLANS = [
    "",                                                         # default | default
    "fwd_w=16,bwd_rows=4,bwd_packs=2,bwd_minb=2",               # 16 KiB tiles | W=16 x 2 packs, 2 x 32 KiB, 2 blocks/SM
    "fwd_rows=4,bwd_rows=8,bwd_minb=2",                         # rows 4, W=16 | W=32, 2 x 32 KiB, 2 blocks/SM
    "fwd_rows=4,fwd_packs=2,bwd_rows=8",                        # W=16 x 2 packs | W=32, 2 x 32 KiB, 1 block/SM
    "fwd_packs=2,bwd_rows=4,bwd_packs=2",                       # W=32 x 2 packs, 64 KiB | W=16 x 2 packs, 1 block/SM
    "fwd_rows=2,fwd_packs=2,bwd_rows=2,bwd_packs=2",            # W=8 x 2 packs | W=8 x 2 packs, 2 x 16 KiB
    "fwd_rows=2,bwd_rows=2,bwd_minb=3",                         # W=8, 8 KiB | W=8, 2 x 8 KiB, 3 blocks/SM
    "fwd_bps=3,bwd_w=8",                                        # 3 blocks/SM | default kernel at W=8
    "fwd_bps=2,bwd_split=2",                                    # 2 blocks/SM | 2 d-splits per token
    "fwd_rows=4,fwd_w=8,bwd_rows=4,bwd_packs=2,bwd_minb=2,bwd_split=2",  # 8 KiB tiles | W=16 x 2, 2 splits
    # cp.async double-buffered tiles (fwd_async / bwd_async; 2 shared stages, no register prefetch):
    "fwd_async=1,bwd_async=1",                                  # W=32, 2 x 32 KiB, 3 blocks/SM | W=16, 2 x 2 x 16 KiB
    "fwd_async=1,fwd_w=16,bwd_async=1,bwd_w=8",                 # W=16, 2 x 16 KiB | W=8, 2 x 2 x 8 KiB
    "fwd_async=1,fwd_rows=4,bwd_async=1,bwd_minb=3",            # rows 4, W=16 | W=16, 3 blocks/SM
    "fwd_async=1,fwd_w=8,bwd_async=1,bwd_rows=8,bwd_w=32",      # W=8, 2 x 8 KiB | W=32, 2 x 2 x 32 KiB
    "fwd_async=1,fwd_bps=2,bwd_async=1,bwd_bps=1",              # 2 blocks/SM | W=16, 1 block/SM
    "bwd_async=1,bwd_split=2",                                  # default | async, 2 d-splits per token
    "",                                                         # default again: run-to-run noise
]


# ---------------------------------------------------------------------------------------------- child
def child(args):
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root (benchmarks, cat_fast)
    import cat_fast
    from benchmarks.tools import kernel_only
    from cat_fast.ops import registry as _registry

    result = {"plan": os.environ.get("CAT_FAST_CMIX_PLAN", ""), "check": "skipped", "times_ms": {}}
    if "cuda" not in cat_fast.backends():
        result["error"] = f"no cuda backend: {_registry.load_errors()}"
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 2
    kernels = _registry.kernels("cuda")

    result["copy_gbps"] = kernel_only.copy_gbps()

    if not args.no_check:
        if not args.full_check:  # the shapes the plan applies to: tile path (B <= 256, D a multiple of 8)
            kernel_only.CHECK_CASES = [c for c in kernel_only.CHECK_CASES if c[0] <= 256 and c[2] % 8 == 0]
        try:
            kernel_only.check(kernels)
            result["check"] = "ok"
        except AssertionError as error:
            result["check"] = "FAIL " + " ".join(str(error).split())[:300]

    B, T, D = SHAPE
    for name in DTYPES:
        dtype = getattr(torch, name)
        h = torch.randn(B, T, D, device="cuda", dtype=dtype)
        grad = torch.randn_like(h)
        lam = torch.rand(B, device="cuda")
        partner = torch.randperm(B, device="cuda")
        fwd, bwd = kernel_only.time_fwd_bwd(kernels, h, grad, lam, partner)
        result["times_ms"][name] = {"fwd": fwd, "bwd": bwd, "nbytes": h.numel() * h.element_size()}
    torch.cuda.synchronize()
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------------------------- parent
def normalize(plan):
    items = [i.strip() for i in re.split(r"[,;]", plan) if i.strip()]
    return ",".join(items)


def keys_of(plan, prefixes):
    return [i for i in normalize(plan).split(",") if i and i.split("=")[0].strip().startswith(prefixes)]


PLAN_LINE = re.compile(r"cat_fast cmix plan: (forward|backward) (\w+) \[(\d+),(\d+),(\d+)\]: (.*)")
DTYPE_NAMES = {"BFloat16": "bfloat16", "Float": "float32", "Half": "float16", "Double": "float64"}


def effective(stderr):
    """{dtype: 'fwd ... | bwd ...'} for the timed shape, from the verbose plan lines."""
    found = {}
    notes = []
    for line in stderr.splitlines():
        m = PLAN_LINE.match(line.strip())
        if "CAT_FAST_CMIX_PLAN: ignored" in line or "override not applied" in line:
            if line.strip() not in notes:
                notes.append(line.strip())
        elif m:
            op, dt, b, t, d, rest = m.groups()
            if (int(b), int(t), int(d)) != SHAPE:
                continue
            kv = dict(re.findall(r"(\w+(?:/\w+)?)=(\S+)", rest.split(" (")[0]))
            src = rest[rest.find("(") + 1:rest.rfind(")")] if "(" in rest else ""
            if op == "forward":
                s = f"fwd W={kv.get('W')} K={kv.get('K')} P={kv.get('rows')} {kv.get('blocks/SM')}/SM"
            else:
                s = f"bwd W={kv.get('W')} K={kv.get('K')} P={kv.get('rows')} M={kv.get('minb')} {kv.get('blocks/SM')}/SM S={kv.get('S')}"
            if src and src != "default":
                s += f" [{src}]" if src != "override" else " [ovr]"
            found.setdefault(DTYPE_NAMES.get(dt, dt), {})[op] = s
    return {k: " | ".join(v.get(op, "?") for op in ("forward", "backward")) for k, v in found.items()}, notes


def run_plan(plan, args):
    env = dict(os.environ)
    env["CAT_FAST_CMIX_PLAN"] = (normalize(plan) + ",verbose=1").lstrip(",")
    cmd = [sys.executable, os.path.abspath(__file__), "--child"]
    if args.no_check:
        cmd.append("--no-check")
    if args.full_check:
        cmd.append("--full-check")
    start = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout_s)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")) + "\n(timed out)"
        rc = -1
    result = None
    for line in out.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
    if result is None:
        tail = " ".join((err or out).strip().splitlines()[-3:])[-400:]
        result = {"plan": plan, "error": f"rc={rc}: {tail}", "times_ms": {}, "check": "n/a"}
    result["plan"] = normalize(plan)
    result["effective"], result["notes"] = effective(err)
    result["wall_s"] = time.time() - start
    return result


def pct(nbytes_moved, ms, copy_gbps):
    return 100.0 * nbytes_moved / ms / 1e6 / copy_gbps


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plans", nargs="*", help="plan strings ('' = default); default: the built-in list")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--full-check", action="store_true")
    parser.add_argument("--no-combine", action="store_true")
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--child-timeout-s", type=float, default=90.0)
    return parser.parse_args()


HEADER = (f"{'plan':58s} {'dtype':9s} {'fwd us':>8s} {'%':>5s} {'bwd us':>8s} {'%':>5s} {'f+b us':>8s} "
          f"{'%':>5s}  check  effective plan")


class _Reporter:
    """Prints each plan's rows as it finishes; the first process that measured the copy bandwidth sets the
    reference (`ref_copy`) for every plan."""

    def __init__(self):
        self.ref_copy = None
        self.printed_header = False

    def __call__(self, res):
        if self.ref_copy is None and res.get("copy_gbps"):
            self.ref_copy = res["copy_gbps"]
            print(f"copy bandwidth {self.ref_copy:,.0f} GB/s (read + write; reference for every plan)", flush=True)
        if not self.printed_header:
            print(HEADER, flush=True)
            self.printed_header = True
        label = res["plan"] or "<default>"
        if res.get("error") or not res["times_ms"]:
            print(f"{label:58s} ERROR {res.get('error', 'no timings')}", flush=True)
            return
        copy = self.ref_copy or res["copy_gbps"]
        for name in DTYPES:
            t = res["times_ms"].get(name)
            if not t:
                continue
            n = t["nbytes"]
            f, b = t["fwd"], t["bwd"]
            check = res["check"] if len(res["check"]) <= 5 else res["check"][:4]
            print(f"{label:58s} {name:9s} {f * 1e3:8.1f} {pct(2 * n, f, copy):5.1f} {b * 1e3:8.1f} {pct(3 * n, b, copy):5.1f} "
                  f"{(f + b) * 1e3:8.1f} {pct(5 * n, f + b, copy):5.1f}  {check:5s}  {res['effective'].get(name, '?')}",
                  flush=True)
        if res["check"].startswith("FAIL"):
            print(f"    check failed: {res['check']}", flush=True)
        for note in res["notes"]:
            print(f"    {note}", flush=True)


def _run_all(todo, args, results, start, report):
    """Each plan in its own process while the budget lasts; appended to `results` and reported."""
    for plan in todo:
        elapsed = time.time() - start
        avg = sum(r["wall_s"] for r in results) / len(results) if results else 0.0
        if results and elapsed + avg > args.budget_s:
            print(f"(budget {args.budget_s:.0f} s: skipped {normalize(plan) or '<default>'})", flush=True)
            continue
        res = run_plan(plan, args)
        results.append(res)
        report(res)


def _valid(results):
    return [r for r in results if r["times_ms"] and not r.get("error") and not r["check"].startswith("FAIL")]


def _best(ok, name, key):
    have = [r for r in ok if name in r["times_ms"]]
    return min(have, key=lambda r: key(r["times_ms"][name])) if have else None


def _combos(ok, results):
    """Per dtype, the best forward's fwd_* knobs with the best backward's bwd_* and fill knobs, where that plan is
    new."""
    combos = []
    for name in DTYPES:
        bf, bb = _best(ok, name, lambda t: t["fwd"]), _best(ok, name, lambda t: t["bwd"])
        if bf is None or bb is None:
            continue
        combo = ",".join(keys_of(bf["plan"], ("fwd_",)) + keys_of(bb["plan"], ("bwd_", "fill")))
        if combo not in {r["plan"] for r in results} and combo not in combos:
            combos.append(combo)
    return combos


def _summary(ok, copy, start):
    print(f"\nsummary ({time.time() - start:.0f} s; copy reference {copy:,.0f} GB/s; copy measured per process "
          f"{min(r.get('copy_gbps', copy) for r in ok):,.0f}..{max(r.get('copy_gbps', copy) for r in ok):,.0f} GB/s)")
    for name in DTYPES:
        defaults = [r for r in ok if r["plan"] == "" and name in r["times_ms"]]
        n = ok[0]["times_ms"][name]["nbytes"] if name in ok[0]["times_ms"] else None
        if n is None:
            continue
        if defaults:
            fb = [r["times_ms"][name]["fwd"] + r["times_ms"][name]["bwd"] for r in defaults]
            print(f"  {name:9s} default fwd+bwd {min(fb) * 1e3:.1f}..{max(fb) * 1e3:.1f} us "
                  f"({pct(5 * n, max(fb), copy):.1f}..{pct(5 * n, min(fb), copy):.1f} % of copy) over {len(fb)} runs")
        for what, key, moved in (("fwd+bwd", lambda t: t["fwd"] + t["bwd"], 5), ("fwd", lambda t: t["fwd"], 2),
                                 ("bwd", lambda t: t["bwd"], 3)):
            r = _best(ok, name, key)
            ms = key(r["times_ms"][name])
            print(f"  {name:9s} best {what:8s} {ms * 1e3:8.1f} us {pct(moved * n, ms, copy):5.1f} % of copy  "
                  f"CAT_FAST_CMIX_PLAN=\"{r['plan']}\"  ({r['effective'].get(name, '?')})")


def main():
    args = _parse_args()
    if args.child:
        return child(args)

    plans = args.plans if args.plans else PLANS
    start = time.time()
    results = []
    print(f"cmix tile-plan sweep, [B,T,D]={list(SHAPE)}, {len(plans)} plans, kernel-only "
          "(kernel_only.time_fwd_bwd: median, L2 evicted clean)", flush=True)
    report = _Reporter()
    _run_all(plans, args, results, start, report)

    ok = _valid(results)
    if not ok:
        print("no plan produced valid timings")
        return 1
    if not args.no_combine:
        combos = _combos(ok, results)
        if combos:
            print("combined best forward + best backward knobs:", flush=True)
            _run_all(combos, args, results, start, report)
            ok = _valid(results)
    _summary(ok, report.ref_copy, start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
