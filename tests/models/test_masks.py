"""`models.capture_safe_masks`: the eager-attention mask built on the device is the transformers one, and the
registry is restored after the block."""
import pytest
import torch

from cat_fast import models
from cat_fast.models import masks
from tests.conftest import tiny_batch, tiny_model

masking_utils, mapping = masks.mask_registry()
pytestmark = pytest.mark.skipif(mapping is None, reason="this transformers has no mask-function registry")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("padded", [True, False])
def test_the_device_built_mask_is_the_transformers_mask(dtype, padded):
    original = mapping["eager"]
    safe = masks.capture_safe_eager_mask(original, masking_utils.sdpa_mask)
    attention = torch.ones(3, 7, dtype=torch.bool)
    if padded:
        attention[1, 4:] = False
        attention[2, 1:] = False
    for skip in (True, False):
        kw = dict(batch_size=3, q_length=7, kv_length=7, mask_function=masking_utils.bidirectional_mask_function,
                  attention_mask=attention, dtype=dtype, allow_is_bidirectional_skip=skip)
        want, got = original(**kw), safe(**kw)
        if want is None:
            assert got is None and skip and not padded
            continue
        assert got.dtype == want.dtype and got.shape == want.shape == (3, 1, 7, 7)
        assert torch.equal(got, want)
        assert bool((got == torch.finfo(dtype).min).any()) == padded


def test_an_eager_model_gives_the_same_logits_inside_and_the_registry_comes_back():
    model = tiny_model("bert", attn="eager").eval()
    batch = tiny_batch("bert")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    original = mapping["eager"]
    want = model(**inputs).logits
    with models.capture_safe_masks():
        assert mapping["eager"] is not original and mapping["eager"].__wrapped__ is original
        with models.capture_safe_masks():  # nested: left as it is
            pass
        assert mapping["eager"].__wrapped__ is original
        got = model(**inputs).logits
    assert mapping["eager"] is original
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="boom"), models.capture_safe_masks():
        raise RuntimeError("boom")
    assert mapping["eager"] is original
