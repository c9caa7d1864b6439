"""Time and process peak memory of `jat` alone: one forward+backward of the mechanism.

q, k, v ~ N(0, s^2) of shape [b, h, n, d]; the score scale s sets how many of the heads'
pairs reach the link threshold rho (s = 0.5: none at rho = 5; s = 2: about 90%). Each
measurement runs in a fresh process (``--child``): seconds of one forward+backward after
one warm-up, and the process's peak resident memory (``ru_maxrss``) in MB (10^6 bytes),
one thread.

    python scripts/jat_alone_cost.py --scales 0.5,2
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def child(scale: float, b: int, h: int, n: int, d: int, rho: float) -> dict[str, float]:
    import torch

    import attnlab

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mech = attnlab.build_mechanism(f"jat(rho={rho})",
                                   attnlab.HeadDims(num_heads=h, head_dim=d, max_len=n))
    qkv = [(scale * torch.randn(b, h, n, d)).requires_grad_() for _ in range(3)]
    seconds = []
    for _ in range(2):  # a warm-up, then the measured call
        start = time.perf_counter()
        mech(*qkv, attnlab.AttnContext()).out.sum().backward()
        seconds.append(time.perf_counter() - start)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6  # KiB on Linux
    return {"scale": scale, "seconds": seconds[-1], "peak_rss_mb": peak_mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", default="0.5,2", help="comma-separated s values")
    parser.add_argument("--shape", default="2,2,2048,32", help="b,h,n,d")
    parser.add_argument("--rho", type=float, default=5.0)
    parser.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    b, h, n, d = (int(x) for x in args.shape.split(","))
    if args.child is not None:
        print(json.dumps(child(args.child, b, h, n, d, args.rho)))
        return
    for s in (float(x) for x in args.scales.split(",")):
        res = subprocess.run([sys.executable, __file__, "--child", str(s), "--shape",
                              args.shape, "--rho", str(args.rho)],
                             capture_output=True, text=True, check=True)
        r = json.loads(res.stdout.strip().splitlines()[-1])
        print(f"s = {s}: {r['seconds']:.2f} s, {r['peak_rss_mb']:.0f} MB peak RSS")


if __name__ == "__main__":
    main()
