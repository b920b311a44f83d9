"""The mediation API takes a tokenizer's BatchEncoding and a list of tokenised batches like one dict."""
import pytest
import torch
from transformers import BatchEncoding

from cat_fast.analysis import mediation as M
from tests.conftest import tiny_batch, tiny_model

INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def test_batch_encoding_and_a_list_of_batches_equal_one_dict():
    model = tiny_model("bert", num_layers=2).eval()
    samples = {k: v for k, v in tiny_batch("bert", batch=4).items() if k in INPUTS}
    width = int(samples["attention_mask"][1].sum())  # row 1 is padded: alone, it is a narrower batch
    parts = [{k: v[1:2, :width] for k, v in samples.items()}, {k: v[[0, 2, 3]] for k, v in samples.items()}]
    zbar = M.treatment_means(model, samples, layers=[2])
    for given in (BatchEncoding(samples), parts):
        got = M.treatment_means(model, given, layers=[2])
        for key in zbar:
            torch.testing.assert_close(got[key], zbar[key])
    want = M.neuron_effects(model, samples, zbar, layers=[2], components=["intermediate"]).effects
    got = M.neuron_effects(model, BatchEncoding(samples), zbar, layers=[2], components=["intermediate"]).effects
    for key in want:
        torch.testing.assert_close(got[key], want[key])


def test_a_wrong_sample_set_names_the_accepted_forms():
    with pytest.raises(ValueError, match="treatment: expected a tokenised batch .*BatchEncoding.* or a list of them"):
        M.treatment_means(tiny_model("bert", num_layers=2), [{"input_ids": torch.ones(1, 2, dtype=torch.long)}])
