"""Print the step cases of a pytest-benchmark JSON: median step, paired ratio to a plain step (and the CAT
layer-mean ratio), peak memory, and the ratio to the compiled plain steps of the same run (the baseline of
benchmarks/RESULTS.md's "Whole-step CUDA graphs": ``plain_compiled_ro`` = ``torch.compile(model,
mode="reduce-overhead")``, ``plain_compiled`` = default mode).
`python benchmarks/tools/paired_summary.py step.json [more.json ...]`"""
import json
import sys

BASELINES = ("plain_compiled_ro", "plain_compiled")

for path in sys.argv[1:]:
    print(f"== {path}")
    rows = [b.get("extra_info", {}) for b in json.load(open(path))["benchmarks"]]
    rows = [e for e in rows if "method" in e]
    base = {(e["method"], e["size"]): e["step_ms"] for e in rows
            if e["method"] in BASELINES and "error" not in e and e.get("step_ms")}
    for e in rows:
        parts = [f"{e['size']:>7s} {e['method']:22s}"]
        if "error" in e:
            print(*parts, "error:", str(e["error"])[:100])
            continue
        parts.append(f"step {e.get('step_ms', float('nan')):7.2f} ms")
        if e.get("paired_ratio"):
            parts.append(f"paired {e['paired_ratio']:.3f} ({e['paired_step_ms']:.1f}/{e['paired_plain_ms']:.1f})")
        if e.get("paired_layer_ratio"):
            parts.append(f"layer-mean {e['paired_layer_ratio']:.3f}")
        if e.get("peak_mib"):
            parts.append(f"peak {e['peak_mib']:.0f} MiB")
        for name in BASELINES:  # same run, separate timings (not paired)
            ms = base.get((name, e["size"]))
            if ms and e.get("step_ms") and e["method"] != name:
                parts.append(f"/{'ro' if name.endswith('_ro') else 'compiled'} {e['step_ms'] / ms:.2f}")
        if "captured_graphs" in e:
            parts.append(f"graphs {e['captured_graphs']}")
        if e.get("compile_s"):
            parts.append(f"compile {e['compile_s']:.0f} s")
        if e.get("capture_s"):
            parts.append(f"capture {e['capture_s']:.1f} s")
        if e.get("step_layer_mean_ms"):
            parts.append(f"layer-mean step {e['step_layer_mean_ms']:.2f} ms")
        print(*parts)
