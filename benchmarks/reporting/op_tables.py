"""The op-level sections: per op, one row per (shape, dtype) with the backends side by side (`op_section_compact`,
the default) or one row per backend (`op_section`, ``--full-ops``), the kernel names behind the launch counts, and
the notes that say how the ops were timed."""
from benchmarks.reporting.markdown import error_row, fmt, short_error, table
from benchmarks.reporting.ratios import gpu_speedup, op_time, speedup
from benchmarks.reporting.results import BACKEND_ORDER, OP_ORDER, by_case, ops_by_name, rank, size_key

_TIMING = (
    "Op timings: CUDA events around each call, L2 evicted (a 256 MiB buffer read, so no dirty line is left to be "
    "written back inside the timed call) before each of 20 repetitions after 5 warm-up calls (which absorb Triton "
    "JIT/autotuning and torch.compile); median. Inputs require grad, so the forward includes autograd recording, as "
    "in training."
)
_LAUNCHES = ("Launches = device activities (kernels + memcpy/memset) per call counted with torch.profiler (target 1 "
             "per direction).")

OP_NOTES = _TIMING + (
    " `fwd+bwd` = forward then "
    "`torch.autograd.grad` of the op's differentiable inputs. GB/s = minimal bytes (each input read once, each "
    "output written once, forward + backward; see each benchmark file's docstring) / fwd+bwd time (forward time "
    "for cal_step_). `% copy BW` = that / the device-to-device copy bandwidth above. `× reference` / `× compile` = "
    "speedup of the fwd+bwd time over eager reference / torch.compile(reference) (default mode, automatic dynamic "
    "shapes). `reference` runs through the public op (same validation as the fused backends). " + _LAUNCHES + " "
    "Small-row cases are latency-bound: there GB/s measures launch overhead, not bandwidth. "
    "`GPU µs` / `GPU % copy BW`: the same call (fwd+bwd, or fwd for cal_step_) timed with the host ahead of the "
    "GPU (a ~2 ms spin kernel queued before the start event, L2 evicted): the GPU time of every kernel the op "
    "launches and the gaps between them, without the Python/dispatch latency of the call — what the op costs inside "
    "a training step whose host runs ahead. The columns before it include that latency (0.1–1.7 ms a call on the "
    "benchmark machine's host). `GPU × compile` = torch.compile(reference) GPU time / this row's GPU time."
)

OP_NOTES_COMPACT = _TIMING + (
    " One row per shape and dtype, the backends side by side in the header's order: `reference` runs "
    "through the public op (same validation as the fused backends), `compile` = torch.compile(reference) (default "
    "mode, automatic dynamic shapes). `GPU µs`: forward then `torch.autograd.grad` of the op's differentiable "
    "inputs (the forward alone for cal_step_) timed with the host ahead of the GPU (a ~2 ms spin kernel queued "
    "before the start event): the GPU time of every kernel the op launches and the gaps between them, without the "
    "Python/dispatch latency of the call — what the op costs inside a training step whose host runs ahead; the "
    "bandwidth targets are read on it. `GPU % copy BW` = minimal bytes (each input read once, each output written "
    "once, forward + backward; see each benchmark file's docstring) / GPU time, as a share of the device-to-device "
    "copy bandwidth above. `call µs`: the same call timed from the host, its Python/dispatch latency included "
    "(0.1–1.7 ms a call on the benchmark machine's host; small-row cases are latency-bound). " + _LAUNCHES + " "
    "`report.py --full-ops` prints one row per backend instead (forward alone, wall-clock GB/s, speedups over "
    "reference and compile)."
)

CPU_NOTE = "perf_counter, median of 10 after 2 warm-up calls, single-threaded (CAT_FAST_BENCH_CPU_THREADS)."


def _shape(entries):
    """(forward + backward measured, launches counted) of one op's cases."""
    return (any("fwdbwd_ms" in e for e in entries),
            any("launches_fwd" in e or "launch_error" in e for e in entries))


def _launch_cell(e, has_bwd):
    if "launch_error" in e:
        return "error"
    if "launches_fwd" not in e:
        return "—"
    return f"{e['launches_fwd']}/{e['launches_bwd']}" if has_bwd else str(e["launches_fwd"])


def _full_header(device, has_bwd, launches):
    header = ["shape", "dtype", "backend", "fwd µs"]
    if has_bwd:
        header.append("fwd+bwd µs")
    header += ["GB/s", "% copy BW", "GPU µs", "GPU % copy BW"] if device == "cuda" else ["GB/s"]
    header += ["× reference", "× compile", "GPU × compile"] if device == "cuda" else ["× reference"]
    if launches:
        header.append("launches fwd/bwd" if has_bwd else "launches")
    return header


def _full_row(e, case, device, has_bwd, launches):
    row = [fmt(e.get("fwd_ms"), 1, 1e3)]
    if has_bwd:
        row.append(fmt(e.get("fwdbwd_ms"), 1, 1e3))
    row.append(fmt(e.get("gbps"), 1))
    if device == "cuda":
        row += [fmt(e.get("pct_copy_bw"), 1), fmt(e.get("gpu_ms"), 1, 1e3), fmt(e.get("pct_copy_bw_gpu"), 1)]
    row += [fmt(speedup(case, e, base), 2) for base in (("reference", "compile") if device == "cuda" else ("reference",))]
    if device == "cuda":
        row.append(fmt(gpu_speedup(case, e), 2))
    if launches:
        row.append(_launch_cell(e, has_bwd))
    return row


def op_section(records, device):
    """One table per op, one row per backend (``--full-ops``)."""
    ops = ops_by_name(records, device)
    if not ops:
        return None
    out = []
    for op in sorted(ops, key=lambda o: rank(o, OP_ORDER)):
        rows_in = sorted(ops[op], key=lambda e: (size_key(e.get("shape")), rank(e.get("dtype"), ("fp32", "bf16")),
                                                 rank(e.get("backend"), BACKEND_ORDER)))
        cases = by_case(rows_in)
        has_bwd, launches = _shape(rows_in)
        header = _full_header(device, has_bwd, launches)
        rows = []
        for e in rows_in:
            row = [e.get("shape"), e.get("dtype"), e.get("backend")]
            if "error" in e:
                rows.append(error_row(row, e, len(header)))
            else:
                rows.append(row + _full_row(e, cases[(e.get("shape"), e.get("dtype"))], device, has_bwd, launches))
        out.append(f"#### `{op}`\n\n" + table(header, rows))
    return "\n\n".join(out)


def _side_by_side(case, value, among):
    """`value(e)` of each backend in `among`, joined with " · " ("—" where missing, "error" where it failed)."""
    return " · ".join("—" if case.get(b) is None else "error" if "error" in case[b] else value(case[b]) for b in among)


def _compact_table(op, entries, device):
    backends = sorted({e.get("backend") for e in entries}, key=lambda b: rank(b, BACKEND_ORDER))
    fused = [b for b in backends if b not in ("reference", "compile")]
    cases = by_case(entries)
    has_bwd, launches = _shape(entries)
    names = " · ".join(backends)
    header = ["shape", "dtype"]
    if device == "cuda":
        header += [f"GPU µs ({names})", f"GPU % copy BW ({' · '.join(fused)})"]
    header.append(f"call µs, {'fwd+bwd' if has_bwd else 'fwd'} ({names})")
    if launches:
        header.append(f"launches{' fwd/bwd' if has_bwd else ''} ({names})")
    rows, errors = [], []
    for shape, dtype in sorted(cases, key=lambda k: (size_key(k[0]), rank(k[1], ("fp32", "bf16")))):
        case = cases[(shape, dtype)]
        row = [shape, dtype]
        if device == "cuda":
            row.append(_side_by_side(case, lambda e: fmt(e.get("gpu_ms"), 1, 1e3), backends))
            row.append(_side_by_side(case, lambda e: fmt(e.get("pct_copy_bw_gpu"), 1), fused))
        row.append(_side_by_side(case, lambda e: fmt(op_time(e), 1, 1e3), backends))
        if launches:
            row.append(_side_by_side(case, lambda e: _launch_cell(e, has_bwd), backends))
        rows.append(row)
        errors += [f"- {shape} {dtype} {b}: {short_error(e['error'])}" for b, e in case.items() if "error" in e]
    return f"#### `{op}`\n\n" + table(header, rows) + ("\n\n" + "\n".join(errors) if errors else "")


def op_section_compact(records, device):
    """One row per (shape, dtype), the backends side by side (`a · b · ...` in backend order) — the default
    for RESULTS.md; `--full-ops` gives `op_section`'s per-backend rows (wall-clock GB/s and ratios included).
    Every number is a value of `op_section`'s tables, unchanged."""
    ops = ops_by_name(records, device)
    if not ops:
        return None
    return "\n\n".join(_compact_table(op, ops[op], device) for op in sorted(ops, key=lambda o: rank(o, OP_ORDER)))


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
