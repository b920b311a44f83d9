"""What the readers of text files share (`cad_readers` for the CAD TSV files, `readers` for users' tables): the text
cleaning, a private ``datasets`` cache directory, and a parser's error on one line.
"""
from __future__ import annotations

import atexit
import csv
import os
import re
import shutil
import tempfile
from typing import List, Optional, Tuple

__all__ = ["clean"]

_CACHE_DIR: Optional[str] = None


def cache_dir() -> str:
    """A temporary ``datasets`` cache directory of this process, removed at exit."""
    global _CACHE_DIR
    if _CACHE_DIR is None or not os.path.isdir(_CACHE_DIR):
        _CACHE_DIR = tempfile.mkdtemp(prefix="cat_fast_datasets_")
        atexit.register(shutil.rmtree, _CACHE_DIR, True)
    return _CACHE_DIR


_BR = re.compile(r"<br(?:\s*/?\s*>|\s*/)", re.IGNORECASE)  # also one malformed "<br / " in the train set
_SPACES = re.compile(r"[ \t]{2,}")


def clean(text: str) -> str:
    """Replace HTML line breaks by a space and collapse runs of spaces."""
    if "<" in text:
        text = _BR.sub(" ", text)
    return _SPACES.sub(" ", text).strip()


def one_line(exc: BaseException) -> str:
    """The reason an exception gives, on one line (``Type: message``, newlines as "; ").

    Follows the exception's causes and prefers the parser's own error (pandas, pyarrow, csv, json, a Unicode
    error) to a wrapper such as ``datasets``' "An error occurred while generating the dataset".
    """
    chain: List[BaseException] = []
    e: Optional[BaseException] = exc
    while e is not None and all(e is not c for c in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    said = [c for c in chain if str(c).strip() and type(c).__name__ != "DatasetGenerationError"] or chain
    parser = [c for c in said if isinstance(c, (UnicodeError, csv.Error, ValueError))
              and type(c).__module__.split(".")[0] in ("pandas", "pyarrow", "_csv", "csv", "json", "builtins")]
    pick = (parser or said)[0]
    text = "; ".join(line.strip() for line in str(pick).splitlines() if line.strip())
    return f"{type(pick).__name__}: {text}" if text else type(pick).__name__


def locate_tsv_problem(path: str, n_columns: int) -> Optional[Tuple[int, str]]:
    """(line, reason) of the first line of a TSV file that is not valid UTF-8 or has more fields than the header."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                return n, f"not valid UTF-8 (byte {raw[e.start]:#04x} at byte {e.start + 1} of the line)"
            fields = line.rstrip("\r\n").count("\t") + 1
            if n > 1 and fields > n_columns and line.strip():
                return n, f"{fields} tab-separated fields, expected {n_columns} (the header's)"
    return None
