"""Print the step cases of a pytest-benchmark JSON: median step, paired ratio to a plain step (and the CAT
layer-mean ratio), peak memory. `python scripts/paired_summary.py step.json [more.json ...]`"""
import json
import sys

for path in sys.argv[1:]:
    print(f"== {path}")
    for b in json.load(open(path))["benchmarks"]:
        e = b.get("extra_info", {})
        if "method" not in e:
            continue
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
        print(*parts)
