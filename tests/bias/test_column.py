"""cat_fast.bias.ColumnBias: a tiny randomly initialised BERT checkpoint (saved to tmp_path with an offline
tokenizer) scored on one column, against the model run by hand one example at a time."""
import json

import pytest
import torch

from cat_fast import data as D
from cat_fast.bias import ColumnBias
from tests.conftest import tiny_model

transformers = pytest.importorskip("transformers")

WORDS = ["a", "man", "woman", "is", "sleeping", "running", "nobody", "the", "dog", "cat", "outside", "not", "."]
MODEL_LABELS = ("contradiction", "entailment", "neutral")  # another order than the NLI data's


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hyp_only")
    vocab = d / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    tok = transformers.BertTokenizerFast(vocab=str(vocab))
    model = tiny_model("bert", num_labels=3, seed=3)
    model.config.id2label = dict(enumerate(MODEL_LABELS))
    model.config.label2id = {n: i for i, n in enumerate(MODEL_LABELS)}
    model.save_pretrained(d)
    tok.save_pretrained(d)
    (d / "cat_fast.json").write_text(json.dumps({"task": "custom", "max_length": 8}))
    return str(d)


def nli():
    prem = ["a man is sleeping .", "the dog is running outside .", "a woman is not running", "the cat"]
    hyp = ["nobody is sleeping", "a dog is outside .", "a woman is running the dog the cat is sleeping outside .",
           "the cat is a cat"]
    return D.CadData("nli", prem, hyp, [2, 0, 2, 1], [True] * 4, [0, 1, 2, 3])


def by_hand(model_dir, texts, max_length):
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    rows = []
    with torch.no_grad():
        for t in texts:
            enc = tok(t, truncation=True, max_length=max_length, return_tensors="pt")
            rows.append(torch.log_softmax(model(**enc).logits[0], -1))
    # the model's order (contradiction, entailment, neutral) -> the data's (entailment, neutral, contradiction)
    return torch.stack(rows)[:, [1, 2, 0]]


def test_hypothesis_only_log_probs(model_dir):
    data = nli()
    cb = ColumnBias(model_dir, column="text_pair")
    assert cb.max_length == 8 and cb.label_names == MODEL_LABELS  # from cat_fast.json and id2label
    got = cb.log_probs(data, batch_size=3)  # padded batches of 3 and 1
    assert got.shape == (4, 3) and got.dtype == torch.float32 and not got.requires_grad
    assert not cb.model.training
    torch.testing.assert_close(got, by_hand(model_dir, data.text_pair, 8), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.logsumexp(got, 1), torch.zeros(4), rtol=0, atol=1e-5)
    torch.testing.assert_close(cb.log_probs(data, batch_size=64), got, rtol=0, atol=1e-5)
    # the column by the data's own name; the premise column; another max_length
    torch.testing.assert_close(ColumnBias(model_dir, column="sentence2").log_probs(data), got, rtol=0, atol=1e-5)
    prem = ColumnBias(model_dir, column="text", max_length=32).log_probs(data, batch_size=2)
    torch.testing.assert_close(prem, by_hand(model_dir, data.text, 32), rtol=0, atol=1e-5)
    assert (prem - got).abs().max() > 1e-4  # a different column gives different scores


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda(model_dir):
    data = nli()
    cb = ColumnBias(model_dir)
    got = cb.log_probs(data, device="cuda")
    assert got.device.type == "cpu"
    torch.testing.assert_close(got, ColumnBias(model_dir).log_probs(data), rtol=0, atol=1e-4)


def test_errors(model_dir, tmp_path):
    data = nli()
    with pytest.raises(ValueError, match="column 'premise' is not one of text, text_pair, sentence1, sentence2"):
        ColumnBias(model_dir, column="premise").log_probs(data)
    single = D.CadData("sentiment", ["a man"], None, [1], [True], [0])
    with pytest.raises(ValueError, match="the data has no text pairs"):
        ColumnBias(model_dir).log_probs(single)
    with pytest.raises(ValueError, match=r"the model's labels \(contradiction, entailment, neutral\) are not the "
                                         r"data's \(Negative, Positive\)"):
        ColumnBias(model_dir, column="text").log_probs(single)
    with pytest.raises(ValueError, match="expected 3 distinct names"):
        ColumnBias(model_dir, label_names=("a", "b"))
    with pytest.raises(ValueError, match="batch_size=0"):
        ColumnBias(model_dir).log_probs(data, batch_size=0)
    from cat_fast.models.pretrained import ModelLoadError

    with pytest.raises(ModelLoadError, match="not found"):
        ColumnBias(str(tmp_path / "nothing"))
    # label_names= names the model's classes when its config does not
    cb = ColumnBias(model_dir, label_names=("neutral", "contradiction", "entailment"))
    torch.testing.assert_close(cb.log_probs(data), ColumnBias(model_dir).log_probs(data)[:, [1, 2, 0]])
