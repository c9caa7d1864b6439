"""How wide `realformer`'s factored form pays at short inputs: training-step times by cap.

`realformer` runs a layer as SDPA over the concatenated queries and keys of every
realformer layer so far while they are at most a cap of head dims wide, then continues
with explicit scores (`mechanisms/priors.py`, `factored_fits`). For inputs under 512 x 512
scores per head this times one training step (forward, backward, AdamW; one thread) of
from-scratch BERT encoders (BERT's dropouts, 0.1) with `realformer` in every head, for
several caps of that short width: 0 is the explicit form throughout, 8 the long-input
cap. Rounds alternate the caps
so that slow phases of the machine hit them alike; each cell is the median of 3 steps.

    python scripts/realformer_factored_width.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import attnlab.mechanisms.priors as priors
from attnlab.bench.lra_cell import plan_for
from attnlab.hf.surgery import apply_plan
from attnlab.models import encoder_config

# (layers, hidden, heads, length, batch): the bench-lra encoder's size at a ListOps length,
# a MiniLM-sized encoder and a BERT-base-sized one at GLUE lengths
SHAPES = [(2, 64, 2, 448, 16), (6, 384, 12, 128, 32), (12, 768, 12, 128, 8)]


def step_ms(model, opt, ids, mask, labels) -> float:
    start = time.perf_counter()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caps", type=int, nargs="+", default=[0, 4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    # heavy: transformers, imported on use
    from transformers import AutoModelForSequenceClassification

    torch.set_num_threads(1)
    for layers, hidden, heads, n, b in SHAPES:
        torch.manual_seed(0)
        cfg = encoder_config("tiny", num_hidden_layers=layers, hidden_size=hidden,
                             num_attention_heads=heads, intermediate_size=2 * hidden,
                             vocab_size=1000, max_position_embeddings=512, num_labels=2)
        model = AutoModelForSequenceClassification.from_config(cfg, attn_implementation="sdpa")
        apply_plan(model, plan_for("realformer"))
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(5, 1000, (b, n))
        mask = torch.ones_like(ids)
        mask[::2, n * 3 // 4:] = 0  # half the rows padded
        labels = torch.randint(0, 2, (b,))
        times: dict[int, list[float]] = {cap: [] for cap in args.caps}
        for _ in range(args.rounds):
            for cap in args.caps:
                priors.FACTORED_SHORT_WIDTH = cap
                step_ms(model, opt, ids, mask, labels)  # warm-up
                times[cap].append(statistics.median(
                    step_ms(model, opt, ids, mask, labels) for _ in range(3)))
        cells = ", ".join(f"cap {cap}: " + " / ".join(f"{t:.0f}" for t in ts)
                          for cap, ts in times.items())
        print(f"{layers} layers, hidden {hidden}, {heads} heads, {b} x {n}: ms per step "
              f"(rounds) {cells}")


if __name__ == "__main__":
    main()
