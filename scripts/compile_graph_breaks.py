"""Where ``torch.compile`` breaks the graph of a planned Hugging Face model, per mechanism.

Each registered mechanism's ``example`` spec in every head of a tiny random BERT (2 layers,
4 heads of 8), eval mode, a padded batch of 3 x 12 tokens; ``torch._dynamo.explain`` counts
the graph breaks of one forward and names where they happen (the innermost attnlab frame)
and why. Prints one line per mechanism and the count that trace into one graph:

    python scripts/compile_graph_breaks.py [NAME ...]

``--train``: instead, one training step (classification loss, backward) of the compiled
model (``aot_eager``) against the same step in eager from the same RNG state: the loss,
every parameter gradient (a missing one counts as zeros: one compiled graph gives zeros to
the unused pooler) and the buffers, at 1e-5; prints OK, DIFF or the error per mechanism.
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


def train_step_matches(name: str, ids: torch.Tensor, mask: torch.Tensor) -> str:
    """'OK', or what differs between a compiled and an eager training step."""
    import copy

    _dynamo.reset()
    model = tiny_bert()
    apply_plan(model, f"all:all:{mechanism_class(name).example}", max_len=16)
    if mechanism_class(name).caps.task_conditioned:
        set_task_id(model, 0)
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="aot_eager")
    losses = []
    for mdl in (model.train(), compiled.train()):
        torch.manual_seed(3)
        loss = mdl(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1, 1])).loss
        if loss is None:
            return "no loss in the output"
        loss.backward()
        losses.append(loss.detach())
    bad = [] if torch.allclose(losses[0], losses[1], atol=1e-5) else ["loss"]
    for (pname, p), p2 in zip(model.named_parameters(), twin.parameters(), strict=True):
        g1 = torch.zeros_like(p) if p.grad is None else p.grad
        g2 = torch.zeros_like(p2) if p2.grad is None else p2.grad
        if not torch.allclose(g1, g2, atol=1e-5, rtol=1e-4):
            bad.append(pname)
    for (bname, b), b2 in zip(model.named_buffers(), twin.buffers(), strict=True):
        if not torch.allclose(b, b2, atol=1e-5):
            bad.append(bname)
    return "OK" if not bad else "DIFF " + ", ".join(bad[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mechanisms (default: every registered one)")
    parser.add_argument("--train", action="store_true",
                        help="compare a compiled training step with eager instead")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 90, (3, 12), generator=g)
    mask = (torch.arange(12)[None] < torch.tensor([12, 8, 5])[:, None]).long()
    names = args.names or attnlab.list_mechanisms()
    if args.train:
        same = 0
        for name in names:
            try:
                verdict = train_step_matches(name, ids, mask)
            except Exception as exc:  # report and go on: this is a survey
                verdict = f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            same += verdict == "OK"
            print(f"{name:22s} {verdict}", flush=True)
        print(f"{same} of {len(names)} compiled training steps equal eager "
              f"(torch {torch.__version__})")
        return
    whole = 0
    for name in names:
        count, where = breaks(name, ids, mask)
        whole += count == 0
        detail = "; ".join(f"{loc} x{n}: {why}" for (loc, why), n in where.items())
        print(f"{name:22s} {count:3d} graph breaks  {detail}", flush=True)
    print(f"{whole} of {len(names)} trace into one graph (torch {torch.__version__})")


if __name__ == "__main__":
    main()
