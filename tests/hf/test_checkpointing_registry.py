"""Every registered mechanism trains alike under Hugging Face gradient checkpointing.

Checkpointing recomputes each layer's forward during the backward. A mechanism whose
training forward draws afresh (performer's features, probsparse's key samples, the
clustered hashes, JAT's probsparse variant, attention dropout) must draw in the
recomputation what it drew in the forward, or the gradients belong to another function
than the loss: those draws go through the global RNG, which checkpointing restores before
it recomputes (``core.masks.training_generator``). Cross-layer state has its own replay
(``hf.backend.Replay``; tests/mechanisms/test_priors_layers.py).

Each mechanism's ``example`` spec on every head of a tiny BertForSequenceClassification
(3 layers, 4 heads of 8, attention dropout 0.1 so that dropout draws too), one training
forward and backward with and without checkpointing from the same global RNG state:
parameter gradients and buffers equal to 1e-6 (fp32 rounding of the same computation;
before the draws went through the global RNG, performer and probsparse differed by as much
as a fresh draw, and routing's centroids were stepped twice). The same under reentrant
checkpointing, whose first forward runs without gradients (routing stepped its centroids
there and again in the recomputation, which then routed by the stepped ones); the
mechanisms that pass state to the next layer are refused there with the fix.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_bert

import attnlab
from attnlab.core import mechanism_class
from attnlab.hf import apply_plan

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*use_cache.*"),
              pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")]

NAMES = attnlab.list_mechanisms()
TIGHT = {"atol": 1e-6, "rtol": 1e-6}


def _step(name: str, batch, checkpointing: bool, reentrant: bool = False
          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parameter gradients, buffers) after one training forward and backward."""
    model = make_tiny_bert("BertForSequenceClassification", num_labels=2,
                           attention_probs_dropout_prob=0.1)
    apply_plan(model, f"all:all:{mechanism_class(name).example}", max_len=16)
    if checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    torch.manual_seed(7)
    model(**batch, labels=torch.tensor([0, 1, 1])).loss.backward()
    return ({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            {n: b.clone() for n, b in model.named_buffers()})


CROSS_LAYER = {"lazyformer", "luna", "predictive", "realformer"}


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("name", NAMES)
def test_checkpointed_step_equals_the_plain_one(name, reentrant, padded_batch):
    """Gradients to 1e-6, and state updated in training (routing's centroids: stepped once,
    not again by the recomputation) equal."""
    if reentrant and name in CROSS_LAYER:
        with pytest.raises(ValueError, match="use_reentrant': False"):
            _step(name, padded_batch, checkpointing=True, reentrant=True)
        return
    plain, plain_buffers = _step(name, padded_batch, checkpointing=False)
    ckpt, ckpt_buffers = _step(name, padded_batch, checkpointing=True, reentrant=reentrant)
    assert plain.keys() == ckpt.keys() and plain
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], **TIGHT, msg=n)
    assert plain_buffers.keys() == ckpt_buffers.keys()
    for n in plain_buffers:
        torch.testing.assert_close(ckpt_buffers[n], plain_buffers[n], **TIGHT, msg=n)
