"""What JAT's exact link counters cost per unit of work: candidate pairs against sorted ranges.

For random heads (q, k ~ N(0, scale^2), batch 8 x 2 heads, head dim 64, rho = 5) this
times ``jump_counts`` with ``method="pairs"``, ``"enumerate"`` and ``"compare"`` (one
thread) and prints the link fraction, the candidate pairs per score entry (P / (g n^2))
and each counter's cost per unit: nanoseconds per candidate pair, per score entry for the
sorted ranges listed (``enumerate``), and per (i, j, k) triple for the sorted ranges
compared (``compare``, the dense-link back end, whose cost does not depend on the links).
``adjacency="auto"`` takes the pairs up to ``_PAIRS_PER_SCORE`` pairs per score entry
(``mechanisms/_jat_adjacency.py``).

    python scripts/jat_counter_costs.py
"""

from __future__ import annotations

import argparse
import time

import torch

from attnlab.mechanisms import _jat_adjacency as adj
from attnlab.mechanisms._jat_pairs import _candidates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["256:2.5", "512:2.0", "512:1.8",
                                                       "1024:2.0"],
                        help="n:scale pairs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for case in args.cases:
        n, scale = int(case.split(":")[0]), float(case.split(":")[1])
        g = torch.Generator().manual_seed(0)
        q, k = (torch.randn(8, 2, n, 64, generator=g) * scale for _ in range(2))
        s, lk = q @ k.transpose(-1, -2), adj.key_length(k)
        x, flat_lk = s.reshape(-1, n, n), lk.reshape(-1, n)
        pairs = 0
        for g0 in range(0, x.shape[0], max(1, adj._GROUP // (n * n))):  # as jump_counts
            sl = slice(g0, g0 + max(1, adj._GROUP // (n * n)))
            cand = _candidates(x[sl], flat_lk[sl], 64, 5.0, False, None)
            if cand is not None and cand[0].numel():
                _, m = torch.unique_consecutive(cand[0] * n + cand[2], return_counts=True)
                pairs += int((m * m).sum())
        ms = {}
        for method in ("pairs", "enumerate", "compare"):
            start = time.perf_counter()
            counts = adj.jump_counts(s, lk, 64, 5.0, False, None, method)
            ms[method] = (time.perf_counter() - start) * 1000
        scores = x.numel()
        print(f"n {n}, scale {scale}: links {int(counts.sum()) / (scores * n):.5f} of the "
              f"triples, {pairs / scores:.2f} pairs per score; pairs {ms['pairs']:.0f} ms "
              f"({ms['pairs'] * 1e6 / max(pairs, 1):.0f} ns a pair), sorted ranges "
              f"{ms['enumerate']:.0f} ms ({ms['enumerate'] * 1e6 / scores:.0f} ns a score), "
              f"compared {ms['compare']:.0f} ms ({ms['compare'] * 1e6 / (scores * n):.2f} ns "
              "a triple)")


if __name__ == "__main__":
    main()
