"""Write benchmarks/RESULTS.md (tables) and benchmarks/tokens_per_s.png from the suite's JSON output.

    python benchmarks/report.py OUT/bench.json [more.json | records.jsonl ...]
        [--out benchmarks/RESULTS.md] [--plot benchmarks/tokens_per_s.png] [--commit SHA] [--device NAME] [--date D]
        [--note TEXT] [--full-ops]

`benchmarks/run_gpu.sh` runs it on the run's raw results (OUT = benchmarks/results/<run>/ by default, ignored by
git) and writes OUT/RESULTS.md and OUT/tokens_per_s.png; pointing --out / --plot at benchmarks/RESULTS.md and
benchmarks/tokens_per_s.png makes a run the current tables of the committed file.

Inputs: `--benchmark-json` files of pytest-benchmark (or of the suite's stand-in fixture), and/or the
CAT_FAST_BENCH_JSONL backup written while the suite runs (used for cases missing from the JSON files,
e.g. when the run was killed before pytest wrote its JSON). Later inputs win on duplicate case names.

The tables are written between `<!-- tables:begin -->` and `<!-- tables:end -->`; everything else in an
existing RESULTS.md (narrative sections added by hand) is kept. Without the markers, the tables are
appended after the existing text.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

BEGIN, END = "<!-- tables:begin -->", "<!-- tables:end -->"
HERE = os.path.dirname(os.path.abspath(__file__))

OP_ORDER = ("cmix", "cal_objective", "cal_step_", "crm_loss", "gs_cosine_loss", "poe_loss", "reweight_loss",
            "learned_mixin_loss", "confidence_regularization_loss")
BACKEND_ORDER = ("triton", "cuda", "cpp", "reference", "compile")
METHOD_ORDER = ("plain", "plain_first_token", "plain_training_layers", "naive_cat", "cat", "cat_eager", "cat_full_last",
                "cat_hf_layers", "cat_hf_clean", "gs_exact", "gs_first_order", "gs_first_order_fwd", "gs_pooled", "gs_pooled_hf_layers",
                "poe", "reweight", "learned_mixin", "conf_reg", "clp", "clp_all", "plain_compiled", "plain_compiled_ro",
                "plain_captured", "plain_fast_captured", "cat_captured", "gs_first_order_fwd_captured",
                "gs_pooled_captured")
METHOD_LABEL = {
    "plain": "(1) plain fine-tuning",
    "plain_first_token": "(1f) plain, first-token last layer",
    "plain_training_layers": "(1t) plain, first-token last layer + training layers",
    "naive_cat": "(2) naive CAT (eager, reference ops)",
    "cat": "(3) cat_fast.CAT (CUDA-graph CAL)",
    "cat_eager": "(3e) cat_fast.CAT, cuda_graph=False",
    "cat_full_last": "(3f) cat_fast.CAT, prune_last_layer=False",
    "cat_hf_layers": "(3h) cat_fast.CAT, fast_resume=False",
    "cat_hf_clean": "(3c) cat_fast.CAT, training_layers=False",
    "gs_exact": "(4) GS exact, token level (h_0)",
    "gs_first_order": "(5) GS first-order central, token level (h_0)",
    "gs_first_order_fwd": "(5f) GS first-order forward, token level (h_0)",
    "gs_pooled": "(6) GS exact, pooled",
    "gs_pooled_hf_layers": "(6h) GS exact, pooled, training_layers=False",
    "poe": "(7p) PoE (bias model)",
    "reweight": "(7r) reweighting (bias model)",
    "learned_mixin": "(7l) learned-mixin +H (bias model)",
    "conf_reg": "(7c) confidence regularisation (bias model)",
    "clp": "(8) CLP, head-only virtual step",
    "clp_all": "(8a) CLP, virtual step of every parameter",
    "plain_compiled": "(9) plain, torch.compile(model)",
    "plain_compiled_ro": "(9r) plain, torch.compile(model, mode=\"reduce-overhead\")",
    "plain_captured": "(10) plain (ERM), CapturedStep",
    "plain_fast_captured": "(10f) plain, ERM(fast=True), CapturedStep",
    "cat_captured": "(11) cat_fast.CAT, CapturedStep",
    "gs_first_order_fwd_captured": "(12f) GS first-order forward (h_0), CapturedStep",
    "gs_pooled_captured": "(12p) GS exact, pooled, CapturedStep",
}


# ----------------------------------------------------------------------------- loading


def load(paths):
    """(records by case name, machine info) from JSON / JSONL inputs."""
    records, machine, commit_info = {}, {}, {}
    backups = []
    for path in paths:
        if path.endswith(".jsonl"):
            backups.append(path)
            continue
        with open(path) as handle:
            data = json.load(handle)
        info = (data.get("machine_info") or {}).get("cat_fast") or {}
        if info and (not machine or (info.get("gpu") and not machine.get("gpu"))):
            machine = info
        commit_info = commit_info or data.get("commit_info") or {}
        for bench in data.get("benchmarks", []):
            records[bench.get("fullname") or bench["name"]] = bench
    for path in backups:
        with open(path) as handle:
            for line in handle:
                line = line.strip()
                if not line:
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a killed run
                key = row.get("fullname") or row.get("name")
                records.setdefault(key, row)
    return list(records.values()), machine, commit_info


# ----------------------------------------------------------------------------- formatting


def fmt(value, digits=1, scale=1.0):
    if value is None:
        return "—"
    try:
        value = float(value) * scale
    except (TypeError, ValueError):
        return str(value)
    if value != value:  # NaN
        return "—"
    if abs(value) >= 1e5:
        return f"{value:,.0f}"
    return f"{value:,.{digits}f}"


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def short_error(text, n=140):
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= n else text[:n] + " …"


def size_key(shape):
    try:
        return tuple(int(x) for x in str(shape).split("x"))
    except ValueError:
        return (sys.maxsize,)


def rank(value, order):
    return order.index(value) if value in order else len(order)


# ----------------------------------------------------------------------------- op tables


def op_time(e):
    return e.get("fwdbwd_ms", e.get("fwd_ms"))


def _ops_by_name(records, device):
    ops = {}
    for r in records:
        e = r.get("extra_info") or {}
        if "op" in e and e.get("device") == device:
            ops.setdefault(e["op"], []).append(e)
    return ops


def op_section(records, device):
    ops = _ops_by_name(records, device)
    if not ops:
        return None
    out = []
    for op in sorted(ops, key=lambda o: rank(o, OP_ORDER)):
        rows_in = sorted(ops[op], key=lambda e: (size_key(e.get("shape")), rank(e.get("dtype"), ("fp32", "bf16")),
                                                 rank(e.get("backend"), BACKEND_ORDER)))
        by_case = {}
        for e in rows_in:
            by_case.setdefault((e.get("shape"), e.get("dtype")), {})[e.get("backend")] = e
        has_bwd = any("fwdbwd_ms" in e for e in rows_in)
        launches = any("launches_fwd" in e or "launch_error" in e for e in rows_in)
        header = ["shape", "dtype", "backend", "fwd µs"]
        if has_bwd:
            header.append("fwd+bwd µs")
        header += ["GB/s", "% copy BW", "GPU µs", "GPU % copy BW"] if device == "cuda" else ["GB/s"]
        header += ["× reference", "× compile", "GPU × compile"] if device == "cuda" else ["× reference"]
        if launches:
            header.append("launches fwd/bwd" if has_bwd else "launches")
        rows = []
        for e in rows_in:
            case = by_case[(e.get("shape"), e.get("dtype"))]
            row = [e.get("shape"), e.get("dtype"), e.get("backend")]
            if "error" in e:
                row += [f"error: {short_error(e['error'])}"] + [""] * (len(header) - 4)
                rows.append(row)
                continue
            row.append(fmt(e.get("fwd_ms"), 1, 1e3))
            if has_bwd:
                row.append(fmt(e.get("fwdbwd_ms"), 1, 1e3))
            row.append(fmt(e.get("gbps"), 1))
            if device == "cuda":
                row.append(fmt(e.get("pct_copy_bw"), 1))
                row.append(fmt(e.get("gpu_ms"), 1, 1e3))
                row.append(fmt(e.get("pct_copy_bw_gpu"), 1))
            for base in (("reference", "compile") if device == "cuda" else ("reference",)):
                ref = case.get(base)
                if ref and "error" not in ref and op_time(ref) and op_time(e):
                    row.append(fmt(op_time(ref) / op_time(e), 2))
                else:
                    row.append("—")
            if device == "cuda":
                ref = case.get("compile")
                ok = ref and "error" not in ref and ref.get("gpu_ms") and e.get("gpu_ms")
                row.append(fmt(ref["gpu_ms"] / e["gpu_ms"], 2) if ok else "—")
            if launches:
                if "launch_error" in e:
                    row.append("error")
                elif "launches_fwd" in e:
                    row.append(f"{e['launches_fwd']}/{e['launches_bwd']}" if has_bwd else str(e["launches_fwd"]))
                else:
                    row.append("—")
            rows.append(row)
        out.append(f"#### `{op}`\n\n" + table(header, rows))
    return "\n\n".join(out)


def op_section_compact(records, device):
    """One row per (shape, dtype), the backends side by side (`a · b · ...` in backend order) — the default
    for RESULTS.md; `--full-ops` gives `op_section`'s per-backend rows (wall-clock GB/s and ratios included).
    Every number is a value of `op_section`'s tables, unchanged."""
    ops = _ops_by_name(records, device)
    if not ops:
        return None
    out = []
    for op in sorted(ops, key=lambda o: rank(o, OP_ORDER)):
        entries = ops[op]
        backends = sorted({e.get("backend") for e in entries}, key=lambda b: rank(b, BACKEND_ORDER))
        fused = [b for b in backends if b not in ("reference", "compile")]
        by_case = {}
        for e in entries:
            by_case.setdefault((e.get("shape"), e.get("dtype")), {})[e.get("backend")] = e
        has_bwd = any("fwdbwd_ms" in e for e in entries)
        launches = any("launches_fwd" in e or "launch_error" in e for e in entries)
        names = " · ".join(backends)
        header = ["shape", "dtype"]
        if device == "cuda":
            header += [f"GPU µs ({names})", f"GPU % copy BW ({' · '.join(fused)})"]
        header.append(f"call µs, {'fwd+bwd' if has_bwd else 'fwd'} ({names})")
        if launches:
            header.append(f"launches{' fwd/bwd' if has_bwd else ''} ({names})")

        def cells(case, value, among=backends):
            row = []
            for b in among:
                e = case.get(b)
                row.append("—" if e is None else "error" if "error" in e else value(e))
            return " · ".join(row)

        def launch(e):
            if "launch_error" in e:
                return "error"
            if "launches_fwd" not in e:
                return "—"
            return f"{e['launches_fwd']}/{e['launches_bwd']}" if has_bwd else str(e["launches_fwd"])

        rows, errors = [], []
        keys = sorted(by_case, key=lambda k: (size_key(k[0]), rank(k[1], ("fp32", "bf16"))))
        for shape, dtype in keys:
            case = by_case[(shape, dtype)]
            row = [shape, dtype]
            if device == "cuda":
                row.append(cells(case, lambda e: fmt(e.get("gpu_ms"), 1, 1e3)))
                row.append(cells(case, lambda e: fmt(e.get("pct_copy_bw_gpu"), 1), fused))
            row.append(cells(case, lambda e: fmt(op_time(e), 1, 1e3)))
            if launches:
                row.append(cells(case, launch))
            rows.append(row)
            errors += [f"- {shape} {dtype} {b}: {short_error(e['error'])}" for b, e in case.items() if "error" in e]
        out.append(f"#### `{op}`\n\n" + table(header, rows) + ("\n\n" + "\n".join(errors) if errors else ""))
    return "\n\n".join(out)


def launch_names_section(records):
    """Kernel names behind the launch counts of the fused backends at their largest size (one line per case)."""
    best = {}
    for r in records:
        e = r.get("extra_info") or {}
        if e.get("device") != "cuda" or "launches_fwd" not in e or e.get("backend") not in ("triton", "cuda"):
            continue
        key = (e["op"], e["backend"])
        if key not in best or size_key(e.get("shape")) > size_key(best[key].get("shape")):
            best[key] = e
    if not best:
        return None
    lines = []
    for (op, backend), e in sorted(best.items(), key=lambda kv: (rank(kv[0][0], OP_ORDER), kv[0][1])):
        fwd = ", ".join(e.get("launch_names_fwd", [])) or "—"
        bwd = ", ".join(e.get("launch_names_bwd", [])) or "—"
        lines.append(f"- `{op}` / {backend} ({e.get('shape')}, {e.get('dtype')}): fwd [{short_error(fwd, 200)}]; "
                     f"bwd [{short_error(bwd, 200)}]")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- step tables


def step_records(records):
    return [r.get("extra_info") or {} for r in records if (r.get("extra_info") or {}).get("method") in METHOD_ORDER]


def step_section(records):
    steps = step_records(records)
    if not steps:
        return None
    by_size = {}
    for e in steps:
        by_size.setdefault(e.get("size"), {})[e["method"]] = e
    header = ["B×T", "method", "attn", "step ms", "tokens/s", "peak MiB", "time × (1)", "paired time × (1)",
              "memory × (1)", "FLOP × (1)", "model TFLOP/s"]
    rows = []
    for size in sorted(by_size, key=size_key):
        methods = by_size[size]
        base = methods.get("plain")
        base_ok = base is not None and "error" not in base
        for method in sorted(methods, key=lambda m: rank(m, METHOD_ORDER)):
            e = methods[method]
            row = [str(size).replace("x", "×"), METHOD_LABEL.get(method, method), e.get("attn", "")]
            if "error" in e:
                row += [f"error: {short_error(e['error'])}"] + [""] * (len(header) - 4)
                rows.append(row)
                continue
            time_ratio = e["step_ms"] / base["step_ms"] if base_ok else None
            mem_ratio = (e["peak_mib"] / base["peak_mib"]) if base_ok and e.get("peak_mib") and base.get("peak_mib") else None
            paired = e.get("paired_ratio")
            paired = fmt(paired, 2) + f" ({e['paired_step_ms']:.1f} / {e['paired_plain_ms']:.1f} ms)" if paired else "—"
            row += [fmt(e.get("step_ms"), 1), fmt(e.get("tokens_per_s"), 0), fmt(e.get("peak_mib"), 0),
                    fmt(time_ratio, 2), paired, fmt(mem_ratio, 2), fmt(e.get("flop_ratio"), 2),
                    fmt(e.get("tflops_per_s"), 1)]
            rows.append(row)
    text = table(header, rows)
    largest = {}
    for e in steps:
        if "flop_ratio_final_backward" in e and e["method"] in ("naive_cat", "cat"):
            if e["method"] not in largest or size_key(e.get("size")) > size_key(largest[e["method"]].get("size")):
                largest[e["method"]] = e
    ratios = ", ".join(f"{m} {e['flop_ratio']:.2f} → {e['flop_ratio_final_backward']:.2f} ({e.get('size')})"
                       for m, e in sorted(largest.items(), key=lambda kv: rank(kv[0], METHOD_ORDER)))
    like_for_like = {"plain_first_token": [], "plain_training_layers": []}
    for size in sorted(by_size, key=size_key):
        for base, found in like_for_like.items():
            cat, cut = by_size[size].get("cat"), by_size[size].get(base)
            if cat and cut and cat.get("paired_ratio") and cut.get("paired_ratio"):
                found.append(f"{size.replace('x', '×')} {cat['paired_ratio'] / cut['paired_ratio']:.2f}")
    timer = "CUDA-event timings" if steps[0].get("device") == "cuda" else "perf_counter timings (CPU smoke run)"
    notes = [
        "Step = forward, loss, backward, AdamW step, zero_grad; bf16 autocast; median of "
        f"{timer} over {steps[0].get('timed_steps', '?')} steps after {steps[0].get('warmup_steps', '?')} warm-up steps. "
        "Peak memory = torch.cuda.max_memory_allocated over the timed steps (weights, grads, AdamW state included). "
        "`paired time × (1)`: the method and a plain SDPA step on a second model, timed right after, interleaved "
        "in blocks of 2 steps (20 rounds, the order flipped every round; steady state, one synchronisation at the "
        "end); median method / median plain of that pair (both medians in parentheses). The small-batch steps are "
        "host-bound and the host's speed drifts; the pair shares the drift. The targets are read on it.",
        "FLOP × (1): matmul FLOPs from the config (forward 2·params·tokens + attention 4·B·T²·D·L, backward 2×), "
        "CAT adds per CAL step a forward + input-only backward of layers m+1..L (m = 9, the mean of {8, 9, 10}) and "
        "the final counterfactual forward, which runs without autograd (detached CRM weight). Counting a backward "
        "of that final pass as well (the issue's formula) gives: "
        + ratios + ".",
        "GS first-order at h_0 (FLOP × (1) column): g is an input-only backward (~1 forward) and each perturbed pass "
        "a forward + full backward (3 forwards): central (2 passes) 10/3 = 3.33×, forward (1 pass) 7/3 = 2.33×.",
        "First-token last layer: (1f), (1t), (3), (3e), (3h), (3c), (5), (5f), (6) and (6h) run layer L of every "
        "pass for row 0 only (keys and values of every token, the rest of the layer for row 0; same logits and "
        "gradients); their FLOP counts include it. (1), (2), (3f) and (4) run it whole.",
        "Training layers (`cat_fast.layers.training`: each encoder layer one autograd node, its parameter gradients "
        "included; same values, dropout draws and gradients): (1t), (6) and the clean forward of (3), (3e), (3f), "
        "(3h) run them, and so do the perturbed passes of (5) and (5f); (1), (1f), (2), (3c), (4) and (6h) run the "
        "model's own layers.",
        "Model TFLOP/s = those FLOPs / step time.",
    ]
    if like_for_like["plain_first_token"]:
        notes.append("CAT against a plain step with the same first-token cut, (3) paired / (1f) paired: "
                     + ", ".join(like_for_like["plain_first_token"]) + ".")
    if like_for_like["plain_training_layers"]:
        notes.append("CAT against a plain step with the same first-token cut and training layers, (3) paired / (1t) "
                     "paired: " + ", ".join(like_for_like["plain_training_layers"]) + ".")
    return text + "\n\n" + "\n".join(f"- {n}" for n in notes)


def layer_section(records):
    """CAT steps by the mixing layer drawn at each step (records that carry `paired_by_layer`)."""
    rows = []
    for e in sorted((e for e in step_records(records) if e.get("paired_by_layer")),
                    key=lambda e: (size_key(e.get("size")), rank(e["method"], METHOD_ORDER))):
        by = e["paired_by_layer"]
        layers = sorted(by, key=int)
        cells = ", ".join(f"m={m}: {by[m][0]:.1f} ({by[m][1]})" for m in layers)
        rows.append([str(e.get("size")).replace("x", "×"), METHOD_LABEL.get(e["method"], e["method"]), cells,
                     fmt(e.get("paired_layer_mean_ms"), 1), fmt(e.get("paired_plain_ms"), 1),
                     fmt(e.get("paired_layer_ratio"), 2), fmt(e.get("paired_ratio"), 2), fmt(e.get("flop_ratio"), 2)])
    if not rows:
        return None
    header = ["B×T", "method", "paired steps: median ms at each drawn m (calls)", "mean over m", "plain median",
              "layer-mean ratio", "median ratio", "FLOP × (1)"]
    note = ("- CAT draws m uniformly from its layers at every step ({8, 9, 10} of BERT-base's 12): a step at m = 8 "
            "resumes 4 layers, one at m = 10 two, so the step times have three modes and their median follows "
            "whichever mode the draws in the timed window favour. `mean over m` = the mean of the three per-layer medians: the expected step cost, for the same "
            "mean m as the FLOP count; `layer-mean ratio` = that / the paired plain median.")
    return table(header, rows) + "\n\n" + note


def sync_section(records):
    for r in records:
        e = r.get("extra_info") or {}
        if e.get("method") == "cat_sync_check" or "sync_cat" in e:
            if "error" in e:
                return f"- host-sync check failed to run: {short_error(e['error'], 300)}"
            lines = []
            for key, label in (("sync_cat_nomask", "CAT step (forward + backward), batch without padding mask"),
                               ("sync_cat", "CAT step, padded batch with attention_mask"),
                               ("sync_plain_nomask", "plain step, batch without padding mask"),
                               ("sync_plain", "plain step, padded batch with attention_mask")):
                if key in e:
                    value = e[key]
                    if e.get(key + "_raised") is None and value is not None:
                        verdict = "not checked (no CUDA device)"
                    else:
                        verdict = "no host sync" if value is None else f"RAISED: {short_error(value, 300)}"
                    lines.append(f"- {label} (B×T {e.get('size')}): {verdict}")
            lines.append("- torch.cuda.set_sync_debug_mode(\"error\"); the target is no host sync in the CAT step. "
                         "Hugging Face's SDPA mask creation (`padding_mask.all()`) syncs on padded batches (the plain "
                         "step's own forward); cat_fast gives SDPA models their 4-D mask (`models.sync_free_inputs`), "
                         "so its passes skip that check.")
            return "\n".join(lines)
    return None


# ----------------------------------------------------------------------------- plot


def plot(records, path, device_name=None):
    steps = [e for e in step_records(records) if e.get("method") in ("plain", "naive_cat", "cat", "cat_eager")
             and "error" not in e and e.get("size") != "32x512"]
    if not steps:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, marker in (("plain", "o"), ("naive_cat", "s"), ("cat", "^"), ("cat_eager", "v")):
        points = sorted((e["batch"], e["tokens_per_s"], e["size"]) for e in steps if e["method"] == method)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, label=METHOD_LABEL[method])
    sizes = sorted({(e["batch"], e["size"]) for e in steps})
    ax.set_xscale("log", base=2)
    ax.set_xticks([b for b, _ in sizes])
    ax.set_xticklabels([s.replace("x", "×") for _, s in sizes])
    ax.set_xlabel("batch size B × sequence length T")
    ax.set_ylabel("tokens / s")
    device = device_name or steps[0].get("device", "")
    ax.set_title(f"BERT-base training step, bf16 ({device})", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- assembly


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:
        return None


def header_section(machine, commit_info, args):
    now = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')
    commit = args.commit or machine.get("git_commit") or (commit_info or {}).get("id") or git_commit() or "unknown"
    dirty = (commit_info or {}).get("dirty") and not args.commit
    if machine:
        device = args.device or machine.get("gpu") or "CPU only (no CUDA device)"
    else:  # only the JSONL backup survived (run killed before pytest wrote its JSON)
        device = args.device or "unknown (no --benchmark-json machine info; see env.txt of the run)"
    if machine.get("gpu_count", 1) and machine.get("gpu_count", 1) > 1:
        device += f" (×{machine['gpu_count']} on the host; one used)"
    lines = [
        f"- Device: {device}" + (f", {machine['gpu_memory_gib']} GiB" if machine.get("gpu_memory_gib")
                                 and not args.device else ""),
        f"- Date: {args.date or machine.get('date') or now}",
        f"- torch {machine.get('torch', '?')} (CUDA {machine.get('cuda') or '—'}), triton {machine.get('triton') or '—'}, "
        f"transformers {machine.get('transformers') or '—'}, Python {machine.get('python', '?')}",
        f"- Commit: `{commit}`" + (" (working tree had uncommitted changes)" if dirty else ""),
        f"- cat_fast backends: {', '.join(machine.get('cat_fast_backends') or []) or '?'}",
    ]
    if machine.get("copy_gbps"):
        lines.append(f"- Device-to-device copy bandwidth (512 MiB, bytes read + written, same run, timed as the ops): "
                     f"{machine['copy_gbps']:,.0f} GB/s")
    errors = machine.get("cat_fast_load_errors") or {}
    if errors:
        lines.append("- Backend load errors: " + "; ".join(f"{k}: {short_error(v)}" for k, v in errors.items()))
    return "\n".join(lines)


OP_NOTES = (
    "Op timings: CUDA events around each call, L2 evicted (a 256 MiB buffer read, so no dirty line is left to be "
    "written back inside the timed call) before each of 20 repetitions after 5 "
    "warm-up calls (which absorb Triton JIT/autotuning and torch.compile); median. Inputs require grad, so the "
    "forward includes autograd recording, as in training. `fwd+bwd` = forward then "
    "`torch.autograd.grad` of the op's differentiable inputs. GB/s = minimal bytes (each input read once, each "
    "output written once, forward + backward; see each benchmark file's docstring) / fwd+bwd time (forward time "
    "for cal_step_). `% copy BW` = that / the device-to-device copy bandwidth above. `× reference` / `× compile` = "
    "speedup of the fwd+bwd time over eager reference / torch.compile(reference) (default mode, automatic dynamic "
    "shapes). `reference` runs through the public op (same validation as the fused backends). Launches = device "
    "activities (kernels + memcpy/memset) per call counted with torch.profiler (target 1 per direction). "
    "Small-row cases are latency-bound: there GB/s measures launch overhead, not bandwidth. "
    "`GPU µs` / `GPU % copy BW`: the same call (fwd+bwd, or fwd for cal_step_) timed with the host ahead of the "
    "GPU (a ~2 ms spin kernel queued before the start event, L2 evicted): the GPU time of every kernel the op "
    "launches and the gaps between them, without the Python/dispatch latency of the call — what the op costs inside "
    "a training step whose host runs ahead. The columns before it include that latency (0.1–1.7 ms a call on the "
    "benchmark machine's host). `GPU × compile` = torch.compile(reference) GPU time / this row's GPU time."
)


OP_NOTES_COMPACT = (
    "Op timings: CUDA events around each call, L2 evicted (a 256 MiB buffer read, so no dirty line is left to be "
    "written back inside the timed call) before each of 20 repetitions after 5 warm-up calls (which absorb Triton "
    "JIT/autotuning and torch.compile); median. Inputs require grad, so the forward includes autograd recording, as "
    "in training. One row per shape and dtype, the backends side by side in the header's order: `reference` runs "
    "through the public op (same validation as the fused backends), `compile` = torch.compile(reference) (default "
    "mode, automatic dynamic shapes). `GPU µs`: forward then `torch.autograd.grad` of the op's differentiable "
    "inputs (the forward alone for cal_step_) timed with the host ahead of the GPU (a ~2 ms spin kernel queued "
    "before the start event): the GPU time of every kernel the op launches and the gaps between them, without the "
    "Python/dispatch latency of the call — what the op costs inside a training step whose host runs ahead; the "
    "bandwidth targets are read on it. `GPU % copy BW` = minimal bytes (each input read once, each output written "
    "once, forward + backward; see each benchmark file's docstring) / GPU time, as a share of the device-to-device "
    "copy bandwidth above. `call µs`: the same call timed from the host, its Python/dispatch latency included "
    "(0.1–1.7 ms a call on the benchmark machine's host; small-row cases are latency-bound). Launches = device "
    "activities (kernels + memcpy/memset) per call counted with torch.profiler (target 1 per direction). "
    "`report.py --full-ops` prints one row per backend instead (forward alone, wall-clock GB/s, speedups over "
    "reference and compile)."
)


def build(records, machine, commit_info, args, plotted):
    parts = ["## Current tables", header_section(machine, commit_info, args)]
    if getattr(args, "note", None):
        parts.append(args.note)
    full_ops = getattr(args, "full_ops", False)
    section = op_section if full_ops else op_section_compact
    gpu_ops = section(records, "cuda")
    if gpu_ops:
        parts += ["### Op level (GPU)", OP_NOTES if full_ops else OP_NOTES_COMPACT, gpu_ops]
        names = launch_names_section(records)
        if names:
            parts += ["Kernels counted (fused backends, largest size):", names]
    steps = step_section(records)
    if steps:
        parts += ["### Step level (BERT-base)", steps]
        if plotted:
            parts.append(f"![tokens/s]({os.path.basename(args.plot)})")
        layers = layer_section(records)
        if layers:
            parts += ["### CAT steps by mixing layer", layers]
    sync = sync_section(records)
    if sync:
        parts += ["### Host synchronisation in the CAT step", sync]
    cpu_ops = section(records, "cpu")
    if cpu_ops:
        parts += ["### Op level (CPU small set: cpp vs reference)",
                  "perf_counter, median of 10 after 2 warm-up calls, single-threaded (CAT_FAST_BENCH_CPU_THREADS).",
                  cpu_ops]
    skipped = [r for r in records if "error" in (r.get("extra_info") or {})]
    if skipped:
        parts.append(f"{len(skipped)} case(s) recorded an error (shown in the tables).")
    return "\n\n".join(parts)


def write_results(path, body):
    block = f"{BEGIN}\n{body}\n{END}"
    if os.path.exists(path):
        with open(path) as handle:
            text = handle.read()
        if BEGIN in text and END in text:
            start, end = text.index(BEGIN), text.index(END) + len(END)
            text = text[:start] + block + text[end:]
        else:
            text = text.rstrip() + "\n\n" + block + "\n"
    else:
        text = ("# cat_fast benchmark results\n\n"
                "Generated by `benchmarks/report.py` from the `--benchmark-json` output of `benchmarks/` "
                "(`benchmarks/run_gpu.sh`). Text outside the table markers is kept on regeneration.\n\n"
                + block + "\n")
    with open(path, "w") as handle:
        handle.write(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="--benchmark-json file(s) and/or CAT_FAST_BENCH_JSONL file(s)")
    parser.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    parser.add_argument("--plot", default=os.path.join(HERE, "tokens_per_s.png"))
    parser.add_argument("--commit", default=None, help="commit to print (default: from the JSON, else git rev-parse HEAD)")
    parser.add_argument("--device", default=None, help="device name to print (default: from the JSON)")
    parser.add_argument("--date", default=None, help="date to print (default: from the JSON)")
    parser.add_argument("--note", default=None, help="a paragraph printed under the header (e.g. which run gave which table)")
    parser.add_argument("--full-ops", action="store_true",
                        help="op tables with one row per backend (default: backends side by side, one row per case)")
    args = parser.parse_args(argv)
    paths = [p for p in args.inputs if os.path.exists(p)]
    missing = [p for p in args.inputs if not os.path.exists(p)]
    if missing:
        print(f"report.py: skipping missing input(s): {', '.join(missing)}", file=sys.stderr)
    if not paths:
        print("report.py: no input found", file=sys.stderr)
        return 1
    records, machine, commit_info = load(paths)
    if not machine.get("copy_gbps"):
        copies = [(r.get("extra_info") or {}).get("copy_gbps") for r in records]
        copies = [c for c in copies if c]
        if copies:
            machine = dict(machine, copy_gbps=copies[0])
    plotted = False
    try:
        plotted = plot(records, args.plot, args.device or machine.get("gpu"))
    except Exception as error:  # the tables matter more than the figure
        print(f"report.py: plot failed: {error}", file=sys.stderr)
    body = build(records, machine, commit_info, args, plotted)
    write_results(args.out, body)
    print(f"report.py: {len(records)} records -> {args.out}" + (f", {args.plot}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
