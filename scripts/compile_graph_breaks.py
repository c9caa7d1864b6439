"""Where ``torch.compile`` breaks the graph of a planned Hugging Face model, per mechanism.

Each registered mechanism's ``example`` spec in every head of a tiny random BERT (2 layers,
4 heads of 8), eval mode, a padded batch of 3 x 12 tokens; ``torch._dynamo.explain`` counts
the graph breaks of one forward and names where they happen (the innermost attnlab frame)
and why. Prints one line per mechanism and the count that trace into one graph:

    python scripts/compile_graph_breaks.py [NAME ...]
"""

from __future__ import annotations

import argparse
import collections
import warnings

import torch
from torch import _dynamo
from transformers import BertConfig, BertForSequenceClassification

import attnlab
from attnlab.core import mechanism_class
from attnlab.hf import apply_plan, set_task_id


def tiny_bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=37, max_position_embeddings=64, num_labels=2)
    return BertForSequenceClassification(cfg)


def breaks(name: str, ids: torch.Tensor, mask: torch.Tensor) -> tuple[int, collections.Counter]:
    """(graph breaks, (where, why) -> count) of one eval forward with ``name`` everywhere."""
    _dynamo.reset()
    model = tiny_bert()
    apply_plan(model, f"all:all:{mechanism_class(name).example}", max_len=16)
    if mechanism_class(name).caps.task_conditioned:
        set_task_id(model, 0)
    model.eval()
    with torch.no_grad():
        explained = _dynamo.explain(model)(input_ids=ids, attention_mask=mask)
    where: collections.Counter = collections.Counter()
    for reason in explained.break_reasons:
        ours = [f for f in reason.user_stack if "/attnlab/" in f.filename]
        frame = ours[-1] if ours else (reason.user_stack[-1] if reason.user_stack else None)
        loc = "?" if frame is None else f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
        where[(loc, reason.reason.splitlines()[0][:70])] += 1
    return explained.graph_break_count, where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mechanisms (default: every registered one)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 90, (3, 12), generator=g)
    mask = (torch.arange(12)[None] < torch.tensor([12, 8, 5])[:, None]).long()
    names = args.names or attnlab.list_mechanisms()
    whole = 0
    for name in names:
        count, where = breaks(name, ids, mask)
        whole += count == 0
        detail = "; ".join(f"{loc} x{n}: {why}" for (loc, why), n in where.items())
        print(f"{name:22s} {count:3d} graph breaks  {detail}", flush=True)
    print(f"{whole} of {len(names)} trace into one graph (torch {torch.__version__})")


if __name__ == "__main__":
    main()
