"""Where the GPU waits for the host: idle gaps between kernels in a torch.profiler Chrome trace, attributed to
what the host was running meanwhile (Python frames recorded with ``with_stack=True``, and aten ops).

    python benchmarks/tools/trace_gaps.py TRACE.json [--steps 3] [--min-gap-us 20]

For each GPU idle gap longer than ``--min-gap-us`` (between the union of kernel / memcpy / memset intervals),
the gap is sampled every 5 µs; each sample is charged to the innermost Python frame of the main thread that
covers it, and to the innermost frame in cat_fast / transformers / benchmarks code. Prints the per-step totals
and the largest gaps. The profiler's own tracing slows the host, so the totals are larger than in an untraced
step: read them as shares, not as times.
"""
import argparse
import collections
import json

import numpy as np

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
USER_KEYS = ("cat_fast/", "transformers/", "benchmarks/")


def load(path):
    with open(path) as f:
        return json.load(f)["traceEvents"]


def idle_gaps(spans, min_gap=0.0):
    """Gaps longer than `min_gap` between the union of the (start, end, name) intervals `spans`:
    ``([(gap start, gap end, name before, name after), ...], first start, last end)``."""
    spans = sorted(spans)
    gaps, cur_end, cur_name = [], spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start - cur_end > min_gap:
            gaps.append((cur_end, start, cur_name, name))
        if end > cur_end:
            cur_end, cur_name = end, name
    return gaps, spans[0][0], cur_end


def gpu_gaps(events, min_gap):
    return idle_gaps([(e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                      if e.get("ph") == "X" and e.get("cat") in GPU_CATS], min_gap)


def intervals(events, cat, tid=None):
    sel = [e for e in events if e.get("ph") == "X" and e.get("cat") == cat and (tid is None or e.get("tid") == tid)]
    start = np.array([e["ts"] for e in sel], dtype=np.float64)
    end = start + np.array([e.get("dur", 0) for e in sel], dtype=np.float64)
    return sel, start, end


def innermost(sel, start, end, t, pick=None):
    """Name of the innermost event covering time t (the latest start among those covering it)."""
    idx = np.nonzero((start <= t) & (end >= t))[0]
    if pick is not None:
        idx = [i for i in idx if pick(sel[i]["name"])]
    if len(idx) == 0:
        return "(none)"
    best = max(idx, key=lambda i: (start[i], -end[i]))
    return sel[best]["name"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--min-gap-us", type=float, default=20.0)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    events = load(args.trace)
    gaps, first, last = gpu_gaps(events, args.min_gap_us)
    py = [e for e in events if e.get("ph") == "X" and e.get("cat") == "python_function"]
    main_tid = collections.Counter(e.get("tid") for e in py).most_common(1)[0][0] if py else None
    py_sel, py_start, py_end = intervals(events, "python_function", main_tid)
    op_sel, op_start, op_end = intervals(events, "cpu_op")
    rt_sel, rt_start, rt_end = intervals(events, "cuda_runtime")
    total = sum(b - a for a, b, _, _ in gaps)
    print(f"GPU idle gaps > {args.min_gap_us:.0f} us: {len(gaps)}, {total / 1e3 / args.steps:.2f} ms/step "
          f"(window {(last - first) / 1e3 / args.steps:.2f} ms/step)")
    by_frame, by_user, by_op, by_rt = (collections.Counter() for _ in range(4))
    user = lambda name: any(k in name for k in USER_KEYS)  # noqa: E731
    rows = []
    for a, b, before, after in gaps:
        # restrict each search to the events overlapping the gap
        def window(sel, start, end):
            idx = np.nonzero((start <= b) & (end >= a))[0]
            return [sel[i] for i in idx], start[idx], end[idx]
        pw, ow, rw = window(py_sel, py_start, py_end), window(op_sel, op_start, op_end), window(rt_sel, rt_start, rt_end)
        for t in np.arange(a, b, 5.0):
            w = min(5.0, b - t) / 1e3 / args.steps
            by_frame[innermost(*pw, t)] += w
            by_user[innermost(*pw, t, pick=user)] += w
            by_op[innermost(*ow, t)] += w
            by_rt[innermost(*rw, t)] += w
        mid = (a + b) / 2
        rows.append((b - a, a - first, before, after, innermost(*pw, mid, pick=user), innermost(*ow, mid)))
    for title, counter in (("innermost Python frame", by_frame), ("innermost cat_fast/transformers/benchmarks frame",
                                                                  by_user), ("innermost aten op", by_op),
                           ("CUDA runtime call", by_rt)):
        print(f"-- gap time by {title} (ms/step)")
        for name, ms in counter.most_common(args.top):
            print(f"   {ms:7.3f}  {name[:160]}")
    print("-- largest gaps: us, at ms, kernel before -> after | user frame | aten op (at the middle)")
    for us, at, before, after, frame, op in sorted(rows, reverse=True)[:args.top]:
        print(f"   {us:7.0f} {at / 1e3:8.2f}  {before[:40]} -> {after[:40]} | {frame[:90]} | {op[:40]}")


if __name__ == "__main__":
    main()
