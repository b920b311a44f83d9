"""Print the step cases of a pytest-benchmark JSON: median step, paired ratio to a plain step (and the CAT
layer-mean ratio), peak memory, and the ratio to the compiled plain steps of the same run (the baseline of
benchmarks/RESULTS.md's "Whole-step CUDA graphs": ``plain_compiled_ro`` = ``torch.compile(model,
mode="reduce-overhead")``, ``plain_compiled`` = default mode).
`python benchmarks/tools/paired_summary.py step.json [more.json ...]`"""
import json
import sys

BASELINES = ("plain_compiled_ro", "plain_compiled")
# (field, its text) of the fields a row shows where the record has them (a value that is not 0 or None), in order:
# those before the compiled ratios, then those after.
BEFORE = (
    ("paired_ratio", lambda e: f"paired {e['paired_ratio']:.3f} ({e['paired_step_ms']:.1f}/{e['paired_plain_ms']:.1f})"),
    ("paired_layer_ratio", lambda e: f"layer-mean {e['paired_layer_ratio']:.3f}"),
    ("peak_mib", lambda e: f"peak {e['peak_mib']:.0f} MiB"),
)
AFTER = (
    ("compile_s", lambda e: f"compile {e['compile_s']:.0f} s"),
    ("capture_s", lambda e: f"capture {e['capture_s']:.1f} s"),
    ("step_layer_mean_ms", lambda e: f"layer-mean step {e['step_layer_mean_ms']:.2f} ms"),
)


def _present(e, fields):
    return [text(e) for key, text in fields if e.get(key)]


def row(e, base):
    parts = [f"{e['size']:>7s} {e['method']:22s}"]
    if "error" in e:
        return parts + ["error:", str(e["error"])[:100]]
    parts.append(f"step {e.get('step_ms', float('nan')):7.2f} ms")
    parts += _present(e, BEFORE)
    for name in BASELINES:  # same run, separate timings (not paired)
        ms = base.get((name, e["size"]))
        if ms and e.get("step_ms") and e["method"] != name:
            parts.append(f"/{'ro' if name.endswith('_ro') else 'compiled'} {e['step_ms'] / ms:.2f}")
    if "captured_graphs" in e:  # 0 is shown too: every step ran eagerly
        parts.append(f"graphs {e['captured_graphs']}")
    return parts + _present(e, AFTER)


for path in sys.argv[1:]:
    print(f"== {path}")
    rows = [b.get("extra_info", {}) for b in json.load(open(path))["benchmarks"]]
    rows = [e for e in rows if "method" in e]
    base = {(e["method"], e["size"]): e["step_ms"] for e in rows
            if e["method"] in BASELINES and "error" not in e and e.get("step_ms")}
    for e in rows:
        print(*row(e, base))
