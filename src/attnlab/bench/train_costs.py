"""Training-step costs on the CPU, printed as Markdown: AdamW's three CPU kernels over
MiniLM's parameter shapes, Diff-Prune's gate (autograd reference vs the fused Function),
and the padded tokens an epoch computes on with and without ``train.group_by_length``::

    python -m attnlab.bench.train_costs --threads 1 --repeats 5 --data-dir ../shared/data

The padding table needs the GLUE / CoNLL-2003 files; without them it says so and the
other two tables still print. Times: mean of ``--repeats`` calls after one warm-up.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# MiniLM-L6's parameter shapes: word and position embeddings, 6 layers of 4 attention
# projections, the two feed-forward matrices, and the 1-D biases / LayerNorm vectors.
MINILM_SHAPES = ([(30522, 384), (512, 384)] + [(384, 384)] * 24
                 + [(1536, 384), (384, 1536)] * 6 + [(384,)] * 60)
PADDING_TASKS = ("cola", "sst2", "mrpc", "stsb", "rte", "conll2003")


def _mean_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats


def adamw_table(repeats: int) -> str:
    """One ``AdamW.step()`` over MiniLM's shapes: loop, foreach and fused kernels."""
    rows, base = [], None
    kernels: tuple[tuple[str, dict[str, Any]], ...] = (
        ("per-tensor loop (CPU default)", {}), ("foreach=True", {"foreach": True}),
        ("fused=True", {"fused": True}))
    for name, kw in kernels:
        ps = [torch.nn.Parameter(torch.randn(s)) for s in MINILM_SHAPES]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(ps, lr=1e-4, **kw)
        sec = _mean_seconds(opt.step, repeats)
        base = base or sec
        rows.append(f"| {name} | {sec:.3f} | {base / sec:.2f}x |\n")
    n = sum(torch.Size(s).numel() for s in MINILM_SHAPES)
    return (f"AdamW, one `step()` over MiniLM's {n / 1e6:.1f} M parameters (its tensor "
            f"shapes), mean of {repeats}:\n\n| kernel | s per step | speed-up vs loop |\n"
            "|---|---:|---:|\n" + "".join(rows))


def gate_table(repeats: int) -> str:
    """Diff-Prune's training-time gate on the word-embedding shape, forward + backward."""
    from ..tuning.diff_prune import logistic_noise, noisy_diff, reference_noisy_diff

    shape = (30522, 384)
    theta0, grad = torch.randn(shape), torch.randn(shape)
    w = torch.randn(shape, requires_grad=True)
    log_alpha = torch.full(shape, 5.0, requires_grad=True)
    args = (2 / 3, -0.1, 1.1)

    def ref() -> None:
        reference_noisy_diff(theta0, w, log_alpha, logistic_noise(log_alpha),
                              *args).backward(grad)

    def fused() -> None:
        noisy_diff(theta0, w, log_alpha, logistic_noise(log_alpha), *args).backward(grad)

    t_ref, t_fused = _mean_seconds(ref, repeats), _mean_seconds(fused, repeats)
    return ("Diff-Prune's gate on one 30522 x 384 tensor, forward + backward, mean of "
            f"{repeats}:\n\n| form | s |\n|---|---:|\n| autograd reference "
            f"(`reference_noisy_diff`) | {t_ref:.3f} |\n| fused Function (`noisy_diff`) | "
            f"{t_fused:.3f} |\n\nFused / reference: {t_ref / t_fused:.2f}x faster.\n")


def _padded(lengths: list[int], batches: list[list[int]]) -> int:
    """Tokens computed on when each batch is padded to its longest example."""
    return sum(max(lengths[i] for i in b) * len(b) for b in batches)


def padding_table(data_dir: Path, limit: int = 8000, batch: int = 32) -> str:
    """Tokens an epoch computes on (each batch padded to its longest example)."""
    from ..config import load_config
    from ..recipes.runmodel import build_model
    from ..tasks import get_task
    from ..train.loop import epoch_batches

    if not (data_dir / "glue").is_dir():
        return (f"Padding table skipped: no GLUE data under {data_dir} (pass --data-dir).\n")
    rows = []
    for name in PADDING_TASKS:
        cfg = load_config(f"configs/pasta/{name}.yaml")  # max length 128
        task = get_task(cfg.task.name)
        _, tok = build_model(cfg, task)
        feats = task.encode(task.load(task.train_split, str(data_dir))[:limit], tok, 128)
        lengths = [len(f["input_ids"]) for f in feats]

        plain = _padded(lengths, epoch_batches(len(lengths), batch, 0, 0, 0, 1))
        grouped = _padded(lengths, epoch_batches(len(lengths), batch, 0, 0, 0, 1, lengths))
        rows.append(f"| {name} | {sum(lengths):,} | {plain:,} | {grouped:,} | "
                    f"{plain / grouped:.2f}x |\n")
    return (f"Padded tokens of one epoch (seed 0, batch {batch}, max length 128, the first "
            f"{limit:,} training examples of each task):\n\n| task | real tokens | padded, "
            "plain order | padded, grouped | ratio |\n|---|---:|---:|---:|---:|\n"
            + "".join(rows))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch threads: {args.threads}.\n")
    print(adamw_table(args.repeats))
    print(gate_table(args.repeats))
    print(padding_table(args.data_dir))


if __name__ == "__main__":
    main()
