"""Diagnostic and timing tools of the benchmark suite (each file's docstring says how to run it)."""
import argparse
import os
import subprocess
import sys


def each_size_apart(script: str, sizes, argv) -> bool:
    """For several `sizes`, runs `script` once per size, each in a process of its own with the other arguments of
    `argv` (the command line after the script's name), and returns True; exits naming the size whose run failed.
    False for one size: the caller runs it. A process per size keeps one size's graphs, memory pools and compiled
    peer out of the next size's run (benchmarks/RESULTS.md: the launch failure came only at a process's second
    size)."""
    if len(sizes) < 2:
        return False
    rest = [a for a in argv if a not in sizes]
    for size in sizes:
        if subprocess.run([sys.executable, os.path.abspath(script), size, *rest]).returncode:
            sys.exit(f"{os.path.basename(script)}: the run at {size} failed")
    return True


def size_arg(text: str) -> str:
    """An argparse type: `text` when it is a batch size ``BxT`` of positive integers, else argparse's one-line error
    (exit 2)."""
    parts = text.split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected BxT with positive integers, e.g. 8x128, got {text!r}")
    return text
