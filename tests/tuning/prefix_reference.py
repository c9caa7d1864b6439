"""peft's prefix tuning as the reference for attnlab's own (tests/tuning/test_prefix.py).

The cases are tiny random BERT and RoBERTa classifiers with a seeded prefix; :func:`peft_logits`
runs peft's ``PrefixTuningConfig`` on them (possible only where the installed transformers
still takes peft's key/value cache: <= 5.23 with peft 0.21.2). Recorded with

    python tests/tuning/prefix_reference.py      # needs transformers <= 5.23

into ``prefix_peft_reference.safetensors`` (model weights, prefix weights, inputs and
peft's logits per case), so every installed version is checked against peft's numbers.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from tuning_helpers import bert_pair_batch, make_bert, make_roberta, roberta_pair_batch

REFERENCE = Path(__file__).parent / "prefix_peft_reference.safetensors"
# name -> (model, batch, num_virtual_tokens, prefix_projection, encoder_hidden_size)
CASES = {
    "bert": (make_bert, bert_pair_batch, 4, False, None),
    "bert_mlp": (make_bert, bert_pair_batch, 3, True, 24),
    "roberta": (make_roberta, roberta_pair_batch, 5, False, None),
}


def prefix_state(name: str) -> dict[str, torch.Tensor]:
    """Seeded prefix weights in peft's PrefixEncoder layout (embedding, transform.0/2)."""
    make, _, p, mlp, mid = CASES[name]
    cfg = make().config
    width, flat = cfg.hidden_size, cfg.num_hidden_layers * 2 * cfg.hidden_size
    g = torch.Generator().manual_seed(7)
    if not mlp:
        return {"embedding.weight": torch.randn(p, flat, generator=g)}
    return {"embedding.weight": torch.randn(p, width, generator=g),
            "transform.0.weight": torch.randn(mid, width, generator=g) / width ** 0.5,
            "transform.0.bias": torch.randn(mid, generator=g),
            "transform.2.weight": torch.randn(flat, mid, generator=g) / mid ** 0.5,
            "transform.2.bias": torch.randn(flat, generator=g)}


def peft_logits(name: str, base: torch.nn.Module) -> torch.Tensor:
    """peft's prefix-tuned logits on the case's batch (raises where peft cannot run)."""
    import peft

    _, batch, p, mlp, mid = CASES[name]
    cfg = peft.PrefixTuningConfig(task_type=peft.TaskType.SEQ_CLS, num_virtual_tokens=p,
                                  prefix_projection=mlp,
                                  encoder_hidden_size=mid or base.config.hidden_size)
    model = peft.get_peft_model(copy.deepcopy(base), cfg).eval()
    model.prompt_encoder["default"].load_state_dict(prefix_state(name))
    with torch.no_grad():
        return model(**batch()).logits


def record() -> None:
    from safetensors.torch import save_file

    out = {}
    for name, (make, batch, *_rest) in CASES.items():
        base = make().eval()
        out.update({f"{name}/model/{k}": v.contiguous() for k, v in base.state_dict().items()})
        out.update({f"{name}/batch/{k}": v for k, v in batch().items()})
        out[f"{name}/logits"] = peft_logits(name, base)
    import peft
    import transformers

    save_file(out, str(REFERENCE), metadata={"transformers": transformers.__version__,
                                             "peft": peft.__version__,
                                             "torch": torch.__version__})


if __name__ == "__main__":
    record()
