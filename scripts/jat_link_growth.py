"""How JAT's training steps slow down once its heads grow jump links.

Trains the `bench lra` encoder (2 layers, hidden 64, 2 heads) with `jat` in every head on
one repeated random batch of 16 x 512 tokens (AdamW, lr 1e-3, one thread) and prints,
every ``--every`` steps, the seconds those steps took and how many head groups had a jump
link (their counts are computed and normalised) or none (A_hat = I written directly).

    python scripts/jat_link_growth.py --steps 60 --every 20
"""

from __future__ import annotations

import argparse
import time

import torch

import attnlab.mechanisms.jat as jat
from attnlab.bench.lra_cell import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
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
    model = build_model("jat", "sequence-classification", 10, 32, args.length, 0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(5, 32, (args.batch_size, args.length))
    labels = torch.randint(0, 10, (args.batch_size,))
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
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
