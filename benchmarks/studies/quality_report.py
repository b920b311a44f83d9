"""Tables and bar plots of the quality protocols from the gathered metrics (docs/quality/quality-*.jsonl).

Usage: python benchmarks/studies/quality_report.py docs/quality/quality-*.jsonl --plot docs/quality/quality.png
Prints markdown tables (mean ± sample std over seeds, accuracy in %) for docs/RESULTS-quality.md.
"""
import argparse
import collections
import json
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ORDER = ("erm-orig", "erm", "gs", "gs-random", "cat-star", "cat", "cat-alternate", "cat-gs")


def load(paths):
    groups = collections.defaultdict(list)
    for path in paths:
        for line in open(path):
            run = json.loads(line)
            protocol, method, _seed = run["run"].rsplit("/", 2)  # .../<method label>/seedN
            groups[(protocol, method)].append(run)
    return groups


def summary(runs, name):
    values = [100 * r["eval"][name]["accuracy"] for r in runs]
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return statistics.mean(values), spread


def tables(groups):
    lines = []
    for protocol in sorted({p for p, _ in groups}):
        methods = [m for m in ORDER if (protocol, m) in groups]
        lines += [f"#### `{protocol}`", "", "| method | seeds | dev originals | dev edits | train s (mean) |", "| --- | --- | --- | --- | --- |"]
        for method in methods:
            runs = groups[(protocol, method)]
            orig, edit = summary(runs, "dev_orig"), summary(runs, "dev_edit")
            seconds = statistics.mean(r["train_seconds"] for r in runs)
            lines.append(f"| {method} | {len(runs)} | {orig[0]:.1f} ± {orig[1]:.1f} | {edit[0]:.1f} ± {edit[1]:.1f} | {seconds:.0f} |")
        lines.append("")
    return "\n".join(lines)


def plot(groups, path):
    protocols = sorted({p for p, _ in groups})
    fig, axes = plt.subplots(1, len(protocols), figsize=(3.2 * len(protocols), 3.6), squeeze=False)
    for ax, protocol in zip(axes[0], protocols):
        methods = [m for m in ORDER if (protocol, m) in groups]
        for offset, (name, colour) in enumerate((("dev_orig", "tab:blue"), ("dev_edit", "tab:orange"))):
            stats = [summary(groups[(protocol, m)], name) for m in methods]
            xs = [i + (offset - 0.5) * 0.38 for i in range(len(methods))]
            ax.bar(xs, [s[0] for s in stats], 0.38, yerr=[s[1] for s in stats], color=colour, capsize=2,
                   label="originals" if offset == 0 else "edits")
        low = min(summary(groups[(protocol, m)], n)[0] for m in methods for n in ("dev_orig", "dev_edit"))
        ax.set_ylim(max(0, low - 10), 100)
        ax.set_xticks(range(len(methods)))
        ax.set_xticklabels(methods, rotation=60, ha="right", fontsize=7)
        ax.set_title(protocol, fontsize=8)
        ax.set_ylabel("dev accuracy %", fontsize=7)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("jsonl", nargs="+")
    parser.add_argument("--plot")
    args = parser.parse_args()
    groups = load(args.jsonl)
    print(tables(groups))
    if args.plot:
        plot(groups, args.plot)


if __name__ == "__main__":
    main()
