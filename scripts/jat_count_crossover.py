"""Where JAT's two sorted-range back ends cross: listing the links against comparing ranks.

For random heads (q, k ~ N(0, scale^2), batch 4 x 2 heads, head dim 64, rho = 5; a larger
scale gives more links) this prints the entries ``enumerate`` lists, as a fraction of
n^3, and the time of ``jump_counts`` with ``method="enumerate"`` and ``"compare"`` (one
thread). ``adjacency="auto"`` enumerates below ``_ENUM_FRACTION`` of n^3
(``mechanisms/_jat_adjacency.py``).

    python scripts/jat_count_crossover.py --n 512 --scales 2.1 2.2 2.3 2.4 2.5
"""

from __future__ import annotations

import argparse
import time

import torch

from attnlab.mechanisms import _jat_adjacency as adj


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--scales", type=float, nargs="+", default=[2.1, 2.2, 2.3, 2.4, 2.5])
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = args.n
    for scale in args.scales:
        g = torch.Generator().manual_seed(0)
        q, k = (torch.randn(4, 2, n, 64, generator=g) * scale for _ in range(2))
        s, lk = q @ k.transpose(-1, -2), adj.key_length(k)
        x, flat_lk = adj._clean(s).reshape(-1, n, n), lk.reshape(-1, n)
        p, prefix, _ = adj._boundaries(x, flat_lk, 64, 5.0, False)
        listed = adj._enum_size(p, prefix, None, n) / (x.shape[0] * n**3)
        ms = {}
        for method in ("enumerate", "compare"):
            start = time.perf_counter()
            adj.jump_counts(s, lk, 64, 5.0, False, None, method)
            ms[method] = (time.perf_counter() - start) * 1000
        print(f"n {n}, scale {scale}: enumerate lists {listed:.4f} of n^3; enumerate "
              f"{ms['enumerate']:.0f} ms, compare {ms['compare']:.0f} ms")


if __name__ == "__main__":
    main()
