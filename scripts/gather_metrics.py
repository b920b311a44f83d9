"""Gather every metrics.json under ROOT into one JSON-lines file (the run's path relative to ROOT as "run", the
per-step history left out): python scripts/gather_metrics.py ROOT OUT.jsonl (used by the device run scripts)."""
import json
import pathlib
import sys


def main(root, out):
    root = pathlib.Path(root)
    rows = []
    for path in sorted(root.rglob("metrics.json")):
        m = json.loads(path.read_text())
        m["run"] = str(path.parent.relative_to(root))
        m.pop("history", None)
        rows.append(m)
    with open(out, "w") as f:
        for m in rows:
            f.write(json.dumps(m) + "\n")
    print(len(rows), "runs finished")


if __name__ == "__main__":
    main(*sys.argv[1:3])
