"""Paired timing: mechanisms alternated in one process, their time ratio taken per round.

Why: ``bench speed`` measures each (method, n) in fresh subprocesses, one after another,
and on a shared machine two such measurements drift apart by several percent. A target of
a few percent (a global token's cost over the same window without it) is below that
spread. Here the mechanisms run on the same inputs in one process, alternately (round r
times each of them once, forward and then forward+backward, in the given order in even
rounds and in reverse in odd ones, so that none is always timed first), so slow phases of
the machine hit all of them; the ratio to the first mechanism is taken within each round
and the median over rounds is reported with its range.

Run: ``python -m attnlab.bench.paired --mechanisms band longformer --n 4096``
(bare names take ``bench speed``'s settings, ``bench.suite.BENCH_SPECS``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..core import AttnContext, HeadDims, build_mechanism
from ..io import write_json
from .speed import environment
from .suite import bench_spec


def paired(specs: Sequence[str], n: int, *, heads: int = 12, head_dim: int = 64,
           rounds: int = 9, threads: int | None = 1, seed: int = 0) -> dict[str, Any]:
    """Median time of each mechanism and its per-round ratio to the first one.

    Returns ``{"rows": [...], "settings": {...}}``; a row holds method, fwd_ms and
    fwdbwd_ms (medians over rounds) and fwd_ratio / fwdbwd_ratio as (median, min, max)
    of the per-round ratios to ``specs[0]``."""
    if len(specs) < 2:
        raise ValueError("--mechanisms: name at least two, the first is the baseline")
    if rounds < 1:
        raise ValueError(f"--rounds {rounds}: use at least 1")
    if threads:
        torch.set_num_threads(threads)
    specs = [s if "(" in s else bench_spec(s) for s in specs]
    mechs = [build_mechanism(s, HeadDims(heads, head_dim, max_len=n)).eval() for s in specs]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, n, head_dim, generator=g).requires_grad_()
               for _ in range(3))
    ctx = AttnContext()

    def fwd(m) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            m(q, k, v, ctx)
        return time.perf_counter() - start

    def fwdbwd(m) -> float:
        for t in (q, k, v):
            t.grad = None
        start = time.perf_counter()
        m(q, k, v, ctx).out.sum().backward()
        return time.perf_counter() - start

    for m in mechs:  # warm-up: kernels, caches, allocator
        fwd(m)
        fwdbwd(m)
    times = []  # [round][mech]
    for r in range(rounds):  # odd rounds run the mechanisms in reverse order, so that
        order = range(len(mechs)) if r % 2 == 0 else range(len(mechs) - 1, -1, -1)
        got = {i: (fwd(mechs[i]), fwdbwd(mechs[i])) for i in order}  # no mechanism always first
        times.append([got[i] for i in range(len(mechs))])
    rows = []
    for i, spec in enumerate(specs):
        row: dict[str, Any] = {"method": spec}
        for part, key in ((0, "fwd"), (1, "fwdbwd")):
            row[f"{key}_ms"] = statistics.median(t[i][part] for t in times) * 1000
            ratios = [t[i][part] / t[0][part] for t in times]
            row[f"{key}_ratio"] = (statistics.median(ratios), min(ratios), max(ratios))
        rows.append(row)
    return {"rows": rows, "settings": {"n": n, "heads": heads, "head_dim": head_dim,
                                       "rounds": rounds, "threads": threads, "seed": seed}}


def _child() -> None:
    """Subprocess entry (``bench.speed.run_child``): ``paired`` on the JSON keywords in
    argv[1], its result as one JSON line."""
    print(json.dumps(paired(**json.loads(sys.argv[1]))))


def format_markdown(res: dict[str, Any]) -> str:
    """The rows as a Markdown table: medians and per-round ratios to the first method."""
    base = res["rows"][0]["method"]

    def ratio(r: tuple[float, float, float]) -> str:
        return f"{r[0]:.3f}x ({r[1]:.3f}-{r[2]:.3f})"

    st = res["settings"]
    lines = [
        "| method | fwd ms | fwd+bwd ms | fwd / baseline | fwd+bwd / baseline |",
        "|---|---:|---:|---:|---:|",
        *(f"| `{r['method']}` | {r['fwd_ms']:.1f} | {r['fwdbwd_ms']:.1f} "
          f"| {ratio(r['fwd_ratio'])} | {ratio(r['fwdbwd_ratio'])} |" for r in res["rows"]),
        "",
        f"n = {st['n']}, {st['heads']} heads of {st['head_dim']}, batch 1, fp32, "
        f"{st['threads']} thread(s); medians over {st['rounds']} rounds, each timing every "
        f"method once (forward, then forward+backward); ratios to `{base}` per round: "
        "median (min-max).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mechanisms", nargs="+", required=True,
                    help="names or specs; the first is the baseline of the ratios")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    env = environment(args.threads)
    try:
        res = paired(args.mechanisms, args.n, heads=args.heads, head_dim=args.head_dim,
                     rounds=args.rounds, threads=args.threads)
    except (ValueError, KeyError) as e:
        ap.exit(2, f"error: {e}\n")
    print(format_markdown(res))
    print(f"environment: {env}")
    if args.json:
        write_json(args.json, {"environment": env, **res})


if __name__ == "__main__":
    main()
