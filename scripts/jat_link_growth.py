"""How JAT's training steps slow down once its heads grow jump links.

Trains the `bench lra` encoder (2 layers, hidden 64, 2 heads) with `jat` in every head on
one repeated random batch of 16 x 512 tokens (AdamW, lr 1e-3, one thread) and prints,
every ``--every`` steps, the seconds those steps took and how many head groups had a jump
link (their counts are computed and normalised) or none (A_hat = I written directly).
``--listops`` trains on `bench lra`'s ListOps batches instead (trees of 128-510 tokens,
padded per batch); ``--rho`` sets the threshold (a small one links most triples at once,
the dense-link regime).

    python scripts/jat_link_growth.py --steps 60 --every 20
    python scripts/jat_link_growth.py --listops --rho 0.001 --steps 10 --every 10
"""

from __future__ import annotations

import argparse
import time

import torch

import attnlab.mechanisms.jat as jat
from attnlab.bench.lra_cell import build_model
from attnlab.bench.lra_data import bench_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rho", type=float, default=None, help="jat's rho (default: its own)")
    parser.add_argument("--listops", action="store_true", help="padded ListOps batches")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    groups = {"linked": 0, "unlinked": 0}
    counts_or_none = jat.jump_counts_or_none

    def counted(*a, **kw):
        counts = counts_or_none(*a, **kw)
        groups["unlinked" if counts is None else "linked"] += 1
        return counts

    jat.jump_counts_or_none = counted
    spec = "jat" if args.rho is None else f"jat(rho={args.rho})"
    bs, vocab, data, collate = args.batch_size, 32, None, None
    if args.listops:
        data = bench_data("listops", args.length, args.steps * bs, 16, "../shared/data")
        vocab, collate = len(data.tokenizer), data.task.collator(data.tokenizer, seed=0)
    model = build_model(spec, "sequence-classification", 10, vocab, args.length, 0).train()
    ids = torch.randint(5, 32, (bs, args.length))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "labels": torch.randint(0, 10, (bs,))}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        if data is not None and collate is not None:
            batch = collate([data.train[i] for i in range((step - 1) * bs, step * bs)])
        out = model(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        if step % args.every == 0:
            now = time.perf_counter()
            print(f"steps {step - args.every + 1}-{step}: {now - start:.1f} s; head groups "
                  f"so far: {groups['linked']} linked, {groups['unlinked']} without links")
            start = now


if __name__ == "__main__":
    main()
