"""head_mask: each head's output scaled by xi before the output projection."""

from __future__ import annotations

import pytest
import torch

from attnlab.hf import apply_plan, head_mask

HEAD_DIM = 8  # tiny BERT: hidden 32, 4 heads


def _zero_wo_block(model, layer: int, head: int) -> None:
    """Head (layer, head) contributes nothing: its columns of W_O are zero."""
    dense = model.encoder.layer[layer].attention.output.dense
    with torch.no_grad():
        dense.weight[:, head * HEAD_DIM:(head + 1) * HEAD_DIM] = 0.0


def test_ones_change_nothing_and_the_implementation_comes_back(tiny_bert, padded_batch):
    with torch.no_grad():
        ref = tiny_bert(**padded_batch).last_hidden_state
        with head_mask(tiny_bert, torch.ones(3, 4)):
            assert tiny_bert.config._attn_implementation == "attnlab"
            out = tiny_bert(**padded_batch).last_hidden_state
    assert tiny_bert.config._attn_implementation == "sdpa"
    # attnlab's softmax against transformers' sdpa: float32 rounding only
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert not any(hasattr(m, "_attnlab_head_mask") for m in tiny_bert.modules())


def test_masking_a_head_whose_wo_block_is_zero_changes_nothing(tiny_bert, padded_batch):
    _zero_wo_block(tiny_bert, 1, 2)
    mask = torch.ones(3, 4)
    mask[1, 2] = 0.0
    with torch.no_grad(), head_mask(tiny_bert, torch.ones(3, 4)):
        ref = tiny_bert(**padded_batch).last_hidden_state
    with torch.no_grad(), head_mask(tiny_bert, mask):
        out = tiny_bert(**padded_batch).last_hidden_state
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    mask[1, 1] = 0.0  # a head that does contribute
    with torch.no_grad(), head_mask(tiny_bert, mask):
        assert (tiny_bert(**padded_batch).last_hidden_state - ref).abs().max() > 1e-3


def test_masking_equals_removing_the_heads_output_columns(tiny_bert, padded_batch):
    """xi_h = 0 is the model whose W_O ignores head h: the mask acts before W_O."""
    mask = torch.ones(3, 4)
    mask[0, 3] = 0.0
    with torch.no_grad(), head_mask(tiny_bert, mask):
        masked = tiny_bert(**padded_batch).last_hidden_state
    _zero_wo_block(tiny_bert, 0, 3)
    with torch.no_grad(), head_mask(tiny_bert, torch.ones(3, 4)):
        cut = tiny_bert(**padded_batch).last_hidden_state
    torch.testing.assert_close(masked, cut, rtol=0, atol=1e-6)  # float32 summation order


def test_per_example_masks_equal_one_example_at_a_time(tiny_bert, padded_batch):
    g = torch.Generator().manual_seed(0)
    masks = torch.rand(3, 3, 4, generator=g)  # [b, L, H], any values
    with torch.no_grad(), head_mask(tiny_bert, masks):
        batched = tiny_bert(**padded_batch).last_hidden_state
    for i in range(3):
        one = {k: v[i:i + 1] for k, v in padded_batch.items()}
        with torch.no_grad(), head_mask(tiny_bert, masks[i]):
            alone = tiny_bert(**one).last_hidden_state
        n = int(one["attention_mask"].sum())
        torch.testing.assert_close(batched[i, :n], alone[0, :n], rtol=0, atol=1e-5)


def test_masks_work_with_a_plan_installed(tiny_bert, padded_batch):
    apply_plan(tiny_bert, "0:0-1:band(window=2); 1:all:linear_elu")
    _zero_wo_block(tiny_bert, 1, 0)  # a linear_elu head (no probabilities) contributes nothing
    mask = torch.ones(3, 4)
    mask[1, 0] = 0.0
    with torch.no_grad():
        ref = tiny_bert(**padded_batch).last_hidden_state
        with head_mask(tiny_bert, mask):
            out = tiny_bert(**padded_batch).last_hidden_state
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert tiny_bert.config._attn_implementation == "attnlab"  # the plan's, kept


def test_wrong_shapes_are_refused(tiny_bert, padded_batch):
    with pytest.raises(ValueError, match=r"model of 3 layers x 4 heads; give \[3, 4\]"):
        with head_mask(tiny_bert, torch.ones(4, 3)):
            pass
    with pytest.raises(ValueError, match="batch of 3"):
        with torch.no_grad(), head_mask(tiny_bert, torch.ones(2, 3, 4)):
            tiny_bert(**padded_batch)
