"""cat_fast.data.load_table and read_tsv on bad files: every error is one line that names the file, the line and
the cause; real files in tmp_path."""
import pytest

from cat_fast import data as D
from tests.data.test_tables import error, write_csv, write_jsonl, write_tsv


def test_missing_and_unknown_files(tmp_path):
    msg = error(D.load_table, str(tmp_path / "nope.csv"), text_column="t", label_column="y")
    assert "nope.csv: file or folder not found" in msg and ".jsonl" in msg
    p = tmp_path / "x.xlsx"
    p.write_text("t,y\n")
    msg = error(D.load_table, str(p), text_column="t", label_column="y")
    assert "unknown file type '.xlsx'" in msg and ".csv" in msg
    q = write_csv(tmp_path / "a.csv", [["t", "y"], ["a", "b"]])
    assert "applies to dataset folders only" in error(D.load_table, q, text_column="t", label_column="y", split="train")
    assert "expected different columns" in error(D.load_table, q, text_column="t", label_column="t")


@pytest.mark.parametrize("ext", [".csv", ".tsv", ".jsonl"])
def test_empty_file_and_header_only(tmp_path, ext):
    p = tmp_path / ("e" + ext)
    p.write_text("")
    msg = error(D.load_table, str(p), text_column="t", label_column="y")
    assert msg.startswith(f"{p}: file is empty") and "t, y" in msg
    p.write_text("\ufeff\n\n")  # a BOM and blank lines only
    assert "file is empty" in error(D.load_table, str(p), text_column="t", label_column="y")
    if ext != ".jsonl":
        p.write_text("t,y\n" if ext == ".csv" else "t\ty\n")
        msg = error(D.load_table, str(p), text_column="t", label_column="y")
        assert msg.startswith(f"{p}: no data rows (only the header, line 1)")


def test_missing_columns_listed(tmp_path):
    p = write_csv(tmp_path / "c.csv", [["sentence", "gold"], ["a", "b"]])
    msg = error(D.load_table, p, text_column="text", text_pair_column="hyp", label_column="gold")
    assert msg.startswith(f"{p}: line 1: missing column(s) text, hyp;")
    assert "expected columns text, hyp, gold" in msg and "found sentence, gold" in msg
    p = write_csv(tmp_path / "dup.csv", [["t", "t", "y"], ["a", "b", "c"]])
    assert "column 't' appears 2 times" in error(D.load_table, p, text_column="t", label_column="y")
    q = write_jsonl(tmp_path / "c.jsonl", [{"t": "a", "y": 1}, {"t": "b"}])
    msg = error(D.load_table, q, text_column="t", label_column="y")
    assert msg.startswith(f"{q}: line 2: missing column(s) y;") and "found t" in msg


def test_parse_errors_name_line_and_cause(tmp_path):
    # CSV: a stray quote, an unclosed quote, a wrong number of fields
    p = tmp_path / "q.csv"
    p.write_text('t,y\na,b\n"x"y,c\n')
    msg = error(D.load_table, str(p), text_column="t", label_column="y")
    assert msg.startswith(f"{p}: line 3: cannot be parsed as a comma-separated file") and "',' expected after '\"'" in msg
    p.write_text('t,y\na,b\n"open,c\nmore\n')
    msg = error(D.load_table, str(p), text_column="t", label_column="y")
    assert "line 3:" in msg and "unexpected end of data" in msg and "runs to line 4" in msg
    p.write_text("t,y\na,b\nc,d,e\n")
    msg = error(D.load_table, str(p), text_column="t", label_column="y")
    assert msg.startswith(f"{p}: line 3: 3 field(s), expected 2") and "quote the field" in msg
    # TSV: a tab inside a text, a missing field
    p = write_tsv(tmp_path / "f.tsv", [["t", "y"], ["a", "b"], ["c\td", "e"]])
    msg = error(D.load_table, p, text_column="t", label_column="y")
    assert msg.startswith(f"{p}: line 3: 3 field(s), expected 2") and "a tab inside a text?" in msg
    p = write_tsv(tmp_path / "g.tsv", [["t", "y"], ["a"]])
    assert error(D.load_table, p, text_column="t", label_column="y").startswith(f"{p}: line 2: 1 field(s), expected 2")
    # bad UTF-8
    p = tmp_path / "u.csv"
    p.write_bytes(b"t,y\na,b\nc\xff,d\n")
    msg = error(D.load_table, str(p), text_column="t", label_column="y")
    assert msg.startswith(f"{p}: line 3: not valid UTF-8 (byte 0xff")
    # JSON Lines
    p = write_jsonl(tmp_path / "j.jsonl", [{"t": "a", "y": 1}, '{"t": "b", "y": }'])
    msg = error(D.load_table, p, text_column="t", label_column="y")
    assert msg.startswith(f"{p}: line 2: not valid JSON: Expecting value (column") and "one JSON object per line" in msg
    p = tmp_path / "arr.jsonl"  # a .json file may hold an array (tests/data/test_tables_formats.py)
    p.write_text('[\n{"t": "a", "y": 1}\n]\n')
    assert "starts a JSON array" in error(D.load_table, str(p), text_column="t", label_column="y")
    p = write_jsonl(tmp_path / "list.jsonl", [[1, 2]])
    assert "line 1: a JSON list, expected an object" in error(D.load_table, p, text_column="t", label_column="y")


def test_read_tsv_parse_error_is_one_line_with_cause(tmp_path):
    p = write_tsv(tmp_path / "bad.tsv", [["Sentiment", "Text"], ["Positive", "good"], ["Negative", "bad", "extra"]])
    msg = error(D.read_tsv, p, ["Sentiment", "Text"])
    assert msg.startswith(f"{p}: cannot be read as a tab-separated file: line 3: 3 tab-separated fields, expected 2")
    assert "Expected 2 fields in line 3, saw 3" in msg  # the parser's own reason
    p = tmp_path / "enc.tsv"
    p.write_bytes(b"Sentiment\tText\nPositive\tgo\xffod\n")
    msg = error(D.read_tsv, str(p), ["Sentiment", "Text"])
    assert "line 2: not valid UTF-8" in msg and "UnicodeDecodeError" in msg


def test_cell_errors(tmp_path):
    p = write_csv(tmp_path / "e.csv", [["t", "y", "id"], ["a", "x", "1"], ["b", " ", "2"]])
    msg = error(D.load_table, p, text_column="t", label_column="y")
    assert msg.startswith(f"{p}: line 3: empty label in column 'y'")
    p = write_csv(tmp_path / "ids.csv", [["t", "y", "id"], ["a", "x", "k1"], ["b", "x", "k1"], ["c", "x", ""]])
    msg = error(D.load_table, p, text_column="t", label_column="y", id_column="id")
    assert msg.startswith(f"{p}: line 3: id 'k1'") and "line 2" in msg and "unique id" in msg
    p = write_csv(tmp_path / "ids2.csv", [["t", "y", "id"], ["c", "x", ""]])
    assert error(D.load_table, p, text_column="t", label_column="y", id_column="id").startswith(f"{p}: line 2: empty id")
    q = write_jsonl(tmp_path / "types.jsonl", [{"t": "a", "y": 0.5}])
    assert "line 1: column 'y' holds a fractional number 0.5" in error(D.load_table, q, text_column="t", label_column="y")
    q = write_jsonl(tmp_path / "types2.jsonl", [{"t": ["a"], "y": 1}])
    assert "line 1: column 't' holds a list" in error(D.load_table, q, text_column="t", label_column="y")
    p = write_csv(tmp_path / "allblank.csv", [["t", "y"], ["", "x"], [" ", "y"]])
    msg = error(D.load_table, p, text_column="t", label_column="y")
    assert "all 2 row(s) have empty text" in msg and f"{p}:2" in msg
