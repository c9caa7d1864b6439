"""Jump Self-attention: the exact n^3-free layer against the official n^3 form, on CPU.

What is compared: one JAT layer of ``jat_heads`` heads (``jat(rho=..)``, adjacency
"auto": exact counts on candidate pairs or by sorted ranges, J as sum_m (A^m Q)(A^m K)^T)
against the same layer with ``adjacency="naive"``, a line-by-line port of the official
``get_attn_adj`` (B_k as a [b, h, n, n, n] tensor) and the official propagation
(A Q) K^T A^T. Both give the same A_hat bit for bit (tests/mechanisms/test_jat.py).

Method (why it is done this way):

* Every (form, n) measurement runs in a fresh Python subprocess. PyTorch has no CPU
  allocator statistics, so peak memory is the process's resident-set high-water mark
  after the call minus the resident size just before it (after creating the inputs and a
  warm-up on a tiny input that loads kernels and thread pools; ``bench.speed.DevicePeak``:
  Linux ``VmHWM``, reset at that point, elsewhere the lifetime ``ru_maxrss``). A fresh
  process makes the high-water mark belong to this call alone; it counts everything the
  call touches, so it is an upper bound on tensor memory.
* In the subprocess: forward peak (under ``torch.no_grad``), then forward+backward peak
  (loss = sum of outputs; gradients of q, k, v), then timings: the median of ``repeats``
  calls for each (the memory runs serve as warm-up).
* Inputs: q, k, v ~ N(0, scale^2), fp32, eval mode (no dropout). With scale 2.5 and
  rho = 5 at d = 64 about 1-2% of the (i, j, k) triples are jump links (counted by sorted
  ranges); with scale 1.8 about 0.02% (candidate pairs up to n = 512); the table reports
  the measured fraction and the counter.
* The naive form runs only where its estimated peak (``_NAIVE_BYTES`` per element of the
  n^3 tensor) fits in ``naive_limit_gb``; larger n are listed as skipped.

Run: ``python -m attnlab.bench.jat`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, get_args

import torch

from ..core import AttnContext, HeadDims, build_mechanism
from ..mechanisms.jat import AdjacencyMethod, key_length, link_census
from .speed import DevicePeak, environment, print_results, run_child

# Peak of the official get_attn_adj per element of its [b, h, n, n, n] tensor: measured
# 774 MB for 100.7 M elements (n = 128, b = 8, h = 6), i.e. ~7.7 bytes (a float32 result and
# its quotient briefly alive together, plus bool masks).
_NAIVE_BYTES = 8
# The efficient form's exact link counters (``jat(adjacency=...)`` without "naive", which is
# the official n^3 form this bench compares against).
COUNTERS: tuple[str, ...] = tuple(m for m in get_args(AdjacencyMethod) if m != "naive")


def naive_peak_gb(n: int, batch: int, heads: int) -> float:
    """Estimated peak of the official n^3 adjacency, in GB."""
    return _NAIVE_BYTES * batch * heads * n**3 / 1e9


def measure(
    form: str, n: int, batch: int = 8, heads: int = 6, head_dim: int = 64, repeats: int = 3,
    rho: float = 5.0, scale: float = 2.5, threads: int | None = None, device: str = "cpu",
    counter: str = "auto",
) -> dict[str, Any]:
    """One measurement in *this* process (call it in a fresh one for a valid peak memory).

    On ``device="cuda"`` peak memory is the allocator's (``DevicePeak``) and the clocks wait
    for the GPU.

    form: "efficient" or "naive"; counter: the efficient form's exact link counter
    (``jat(adjacency=...)``: auto, pairs, enumerate, compare or direct). Returns fwd_ms,
    fwdbwd_ms, peak_fwd_mb, peak_mem_mb and, for the efficient form, link_fraction (jump
    links / (b h n^3)) and count_method.
    """
    if threads:
        torch.set_num_threads(threads)
    adjacency = "naive" if form == "naive" else counter
    mech = build_mechanism(
        f"jat(rho={rho}, adjacency={adjacency!r})", HeadDims(heads, head_dim)
    ).eval().to(device)
    ctx = AttnContext()
    peak = DevicePeak(device)

    def make(length: int):
        g = torch.Generator().manual_seed(0)
        shape = (batch, heads, length, head_dim)
        return [(torch.randn(shape, generator=g) * scale).to(device).requires_grad_()
                for _ in range(3)]

    def fwd(q, k, v):
        with torch.no_grad():
            mech(q, k, v, ctx)

    def fwdbwd(q, k, v):
        mech(q, k, v, ctx).out.sum().backward()

    small = make(16)
    fwd(*small)
    fwdbwd(*small)  # warm-up: kernels, thread pools, allocator
    q, k, v = make(n)
    peak.start()
    fwd(q, k, v)
    peak_fwd = peak.mb()
    peak.start()
    fwdbwd(q, k, v)
    peak_all = peak.mb()

    def median_ms(fn) -> float:
        times = []
        for _ in range(repeats):
            for t in (q, k, v):
                t.grad = None
            peak.sync()
            start = time.perf_counter()
            fn(q, k, v)
            peak.sync()
            times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times)  # of an even count: the mean of the middle two

    out: dict[str, Any] = {
        "fwd_ms": median_ms(fwd),
        "fwdbwd_ms": median_ms(fwdbwd),
        "peak_fwd_mb": peak_fwd,
        "peak_mem_mb": peak_all,
    }
    if form != "naive":  # how sparse the links were, and which exact counter ran
        with torch.no_grad():
            x = (q @ k.transpose(-1, -2)).reshape(-1, n, n)[0]  # [n, n] one head is enough
            links, auto = link_census(x, key_length(k).reshape(-1, n)[0], head_dim, rho)
        out["link_fraction"] = links / n**3
        out["count_method"] = counter if counter != "auto" else auto
    return out


def _child() -> None:
    """Subprocess entry: prints one JSON line."""
    print(json.dumps(measure(**json.loads(sys.argv[1]))))


def _measure_in_subprocess(**kwargs: Any) -> dict[str, Any]:
    return run_child("attnlab.bench.jat", kwargs)


def bench_jat(
    lengths: tuple[int, ...] = (128, 256, 512, 1024),
    batch: int = 8,
    jat_heads: int = 6,
    head_dim: int = 64,
    repeats: int = 3,
    *,
    rho: float = 5.0,
    scale: float = 2.5,
    naive_limit_gb: float = 8.0,
    threads: int | None = None,
    progress: bool = False,
    device: str = "cpu",
    counter: str = "auto",
) -> list[dict[str, Any]]:
    """Time and peak memory of the efficient JAT layer vs the official n^3 form.

    Returns one row per (n, form): n, form, fwd_ms, fwdbwd_ms, peak_fwd_mb, peak_mem_mb
    (None when skipped), note, and for the efficient rows link_fraction, count_method and
    fwd_speedup / fwdbwd_speedup / mem_ratio against the naive form at the same n (None
    when the naive form was skipped).
    """
    if counter not in COUNTERS:  # refused before any subprocess runs
        raise ValueError(f"unknown counter {counter!r}; use {', '.join(COUNTERS)}")
    common = dict(batch=batch, heads=jat_heads, head_dim=head_dim, repeats=repeats, rho=rho,
                  scale=scale, threads=threads, device=device, counter=counter)
    rows: list[dict[str, Any]] = []
    for n in lengths:
        for form in ("naive", "efficient"):
            row: dict[str, Any] = {"n": n, "form": form, "note": ""}
            est = naive_peak_gb(n, batch, jat_heads)
            if form == "naive" and est > naive_limit_gb:
                note = f"skipped: n^3 tensor needs ~{est:.0f} GB (limit {naive_limit_gb:g} GB)"
                row.update(fwd_ms=None, fwdbwd_ms=None, peak_fwd_mb=None, peak_mem_mb=None,
                           note=note)
            else:
                row.update(_measure_in_subprocess(form=form, n=n, **common))
            rows.append(row)
            if progress:
                print(f"done {form} n={n}", file=sys.stderr, flush=True)
    naive = {r["n"]: r for r in rows if r["form"] == "naive" and r["fwd_ms"] is not None}
    for r in rows:
        ref = naive.get(r["n"])
        if r["form"] == "efficient":
            r["fwd_speedup"] = ref["fwd_ms"] / r["fwd_ms"] if ref else None
            r["fwdbwd_speedup"] = ref["fwdbwd_ms"] / r["fwdbwd_ms"] if ref else None
            r["mem_ratio"] = (
                r["peak_mem_mb"] / max(ref["peak_mem_mb"], 1e-9) if ref else None
            )
    return rows


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _ratio(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt) + "x"


def format_markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (speed-ups and memory ratio against naive at that n)."""
    head = (
        "| n | form | fwd ms | fwd+bwd ms | peak MB fwd | peak MB fwd+bwd | links | counter "
        "| fwd speed-up | fwd+bwd speed-up | memory vs naive | note |\n"
        "|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|\n"
    )
    body = ""
    for r in rows:
        eff = r["form"] == "efficient"
        body += (
            f"| {r['n']} | {r['form']} | {_num(r['fwd_ms'], '.0f')} "
            f"| {_num(r['fwdbwd_ms'], '.0f')} | {_num(r['peak_fwd_mb'], '.0f')} "
            f"| {_num(r['peak_mem_mb'], '.0f')} "
            f"| {_num(r.get('link_fraction'), '.2%') if eff else ''} "
            f"| {r.get('count_method', '') if eff else ''} "
            f"| {_ratio(r.get('fwd_speedup'), '.1f') if eff else ''} "
            f"| {_ratio(r.get('fwdbwd_speedup'), '.1f') if eff else ''} "
            f"| {_ratio(r.get('mem_ratio'), '.2f') if eff else ''} | {r['note']} |\n"
        )
    return head + body


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--jat-heads", type=int, default=6)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rho", type=float, default=5.0)
    ap.add_argument("--scale", type=float, default=2.5, help="std of the random q, k, v")
    ap.add_argument("--naive-limit-gb", type=float, default=8.0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--counter", default="auto",
                    choices=COUNTERS,
                    help="exact link counter of the efficient form (auto: by device, n and "
                         "the links)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--plot", default=None, help="also draw the scaling curves to this PNG")
    args = ap.parse_args(argv)
    env_before = environment(args.threads)
    rows = bench_jat(
        tuple(args.lengths), args.batch, args.jat_heads, args.head_dim, args.repeats,
        rho=args.rho, scale=args.scale, naive_limit_gb=args.naive_limit_gb,
        threads=args.threads, progress=True, device=args.device, counter=args.counter,
    )
    print_results(format_markdown(rows), rows, env_before, args.json, args.plot)


if __name__ == "__main__":
    main()
