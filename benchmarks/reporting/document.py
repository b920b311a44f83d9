"""The tables' block of RESULTS.md: the run's header (device, date, versions, commit, copy bandwidth), then the op,
step, mixing-layer and host-sync sections; and the tokens/s plot of the step rows."""
import datetime
import os
import subprocess

from benchmarks.reporting import op_tables
from benchmarks.reporting.markdown import short_error
from benchmarks.reporting.results import METHOD_LABEL, step_records
from benchmarks.reporting.step_tables import layer_section, step_section, sync_section

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLOTTED = (("plain", "o"), ("naive_cat", "s"), ("cat", "^"), ("cat_eager", "v"))


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:
        return None


def _device(machine, args):
    if machine:
        device = args.device or machine.get("gpu") or "CPU only (no CUDA device)"
    else:  # only the JSONL backup survived (run killed before pytest wrote its JSON)
        device = args.device or "unknown (no --benchmark-json machine info; see env.txt of the run)"
    if machine.get("gpu_count", 1) and machine.get("gpu_count", 1) > 1:
        device += f" (×{machine['gpu_count']} on the host; one used)"
    return device + (f", {machine['gpu_memory_gib']} GiB" if machine.get("gpu_memory_gib") and not args.device else "")


def header_section(machine, commit_info, args):
    now = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')
    commit = args.commit or machine.get("git_commit") or (commit_info or {}).get("id") or git_commit() or "unknown"
    dirty = (commit_info or {}).get("dirty") and not args.commit
    lines = [
        f"- Device: {_device(machine, args)}",
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


def _step_parts(records, args, plotted):
    steps = step_section(records)
    if not steps:
        return []
    parts = ["### Step level (BERT-base)", steps]
    if plotted:
        parts.append(f"![tokens/s]({os.path.basename(args.plot)})")
    layers = layer_section(records)
    if layers:
        parts += ["### CAT steps by mixing layer", layers]
    return parts


def build(records, machine, commit_info, args, plotted):
    """The markdown between the table markers."""
    parts = ["## Current tables", header_section(machine, commit_info, args)]
    if getattr(args, "note", None):
        parts.append(args.note)
    full_ops = getattr(args, "full_ops", False)
    section = op_tables.op_section if full_ops else op_tables.op_section_compact
    gpu_ops = section(records, "cuda")
    if gpu_ops:
        parts += ["### Op level (GPU)", op_tables.OP_NOTES if full_ops else op_tables.OP_NOTES_COMPACT, gpu_ops]
        names = op_tables.launch_names_section(records)
        if names:
            parts += ["Kernels counted (fused backends, largest size):", names]
    parts += _step_parts(records, args, plotted)
    sync = sync_section(records)
    if sync:
        parts += ["### Host synchronisation in the CAT step", sync]
    cpu_ops = section(records, "cpu")
    if cpu_ops:
        parts += ["### Op level (CPU small set: cpp vs reference)", op_tables.CPU_NOTE, cpu_ops]
    skipped = [r for r in records if "error" in (r.get("extra_info") or {})]
    if skipped:
        parts.append(f"{len(skipped)} case(s) recorded an error (shown in the tables).")
    return "\n\n".join(parts)


def plot(records, path, device_name=None):
    """tokens/s against B×T of the plain and CAT steps (the T = 512 size left out); False when there are none."""
    steps = [e for e in step_records(records) if e.get("method") in dict(PLOTTED)
             and "error" not in e and e.get("size") != "32x512"]
    if not steps:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, marker in PLOTTED:
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
