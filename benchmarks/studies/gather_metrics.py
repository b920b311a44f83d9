"""Gather every metrics.json under ROOT into one JSON-lines file (the run's path relative to ROOT as "run", the
per-epoch history reduced to each epoch's objective info means):
    python benchmarks/studies/gather_metrics.py ROOT OUT.jsonl      (the study runners *_gpu.sh call it)"""
import json
import pathlib
import sys


def main(root, out):
    root = pathlib.Path(root)
    rows = []
    for path in sorted(root.rglob("metrics.json")):
        m = json.loads(path.read_text())
        m["run"] = str(path.parent.relative_to(root))
        history = m.pop("history", None) or []
        m["epoch_info"] = [h.get("info", {}) for h in history]  # the objective's logged means per epoch
        rows.append(m)
    with open(out, "w") as f:
        for m in rows:
            f.write(json.dumps(m) + "\n")
    print(len(rows), "runs finished")


if __name__ == "__main__":
    main(*sys.argv[1:3])
