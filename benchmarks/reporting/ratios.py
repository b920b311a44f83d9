"""The ratios the tables show, computed from the records: op speedups over the reference and torch.compile
backends, step time / memory / FLOP ratios to the plain step, CAT against the plain steps with the same first-token
cut, and the copy bandwidth the op rows' hardware fractions (`% copy BW`) are read against. None where a ratio
cannot be taken (a missing or failed case)."""
from benchmarks.reporting.results import METHOD_ORDER, extra, rank, size_key


def op_time(e):
    """The time an op row is compared on: forward + backward where measured, else the forward."""
    return e.get("fwdbwd_ms", e.get("fwd_ms"))


def _usable(e):
    return e is not None and "error" not in e


def speedup(case, e, base):
    """`base`'s time (a backend of the same case) / this row's time."""
    ref = case.get(base)
    if _usable(ref) and op_time(ref) and op_time(e):
        return op_time(ref) / op_time(e)
    return None


def gpu_speedup(case, e, base="compile"):
    """`base`'s GPU time (host ahead) / this row's."""
    ref = case.get(base)
    if _usable(ref) and ref.get("gpu_ms") and e.get("gpu_ms"):
        return ref["gpu_ms"] / e["gpu_ms"]
    return None


def with_copy_bandwidth(machine, records):
    """`machine` with the copy bandwidth of the first record that carries one, where the machine info lacks it."""
    if machine.get("copy_gbps"):
        return machine
    copies = [c for c in (extra(r).get("copy_gbps") for r in records) if c]
    return dict(machine, copy_gbps=copies[0]) if copies else machine


def step_ratios(e, base):
    """(time, memory) of step record `e` over the plain step `base` of its size (None without a usable plain)."""
    if not _usable(base):
        return None, None
    time_ratio = e["step_ms"] / base["step_ms"]
    memory = e["peak_mib"] / base["peak_mib"] if e.get("peak_mib") and base.get("peak_mib") else None
    return time_ratio, memory


def largest_flop_ratios(steps):
    """{method: record} of naive CAT and CAT at their largest size, for the FLOP ratio with and without a backward
    of the final counterfactual pass."""
    largest = {}
    for e in steps:
        if "flop_ratio_final_backward" in e and e["method"] in ("naive_cat", "cat"):
            if e["method"] not in largest or size_key(e.get("size")) > size_key(largest[e["method"]].get("size")):
                largest[e["method"]] = e
    return dict(sorted(largest.items(), key=lambda kv: rank(kv[0], METHOD_ORDER)))


def like_for_like(by_size, bases=("plain_first_token", "plain_training_layers")):
    """{base: [(size, CAT's paired ratio / base's paired ratio)]}: CAT against the plain steps with the same cut."""
    found = {base: [] for base in bases}
    for size in sorted(by_size, key=size_key):
        for base in bases:
            cat, cut = by_size[size].get("cat"), by_size[size].get(base)
            if cat and cut and cat.get("paired_ratio") and cut.get("paired_ratio"):
                found[base].append((size, cat["paired_ratio"] / cut["paired_ratio"]))
    return found
