"""Scaling curves of a benchmark's rows: time and peak memory against length, log-log.

One line per method (``bench sparse``: "sdpa", "band(window=128)", ...; ``bench jat``:
"naive", "efficient"); points a method skipped (None) are left out, so a line stops where a
method no longer fits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..io import atomic_path


def scaling_plot(rows: list[dict[str, Any]], path: str | Path, title: str = "",
                 subject: str | None = None) -> Path:
    """Write a two-panel PNG (fwd+bwd time, peak memory vs n) for benchmark ``rows``.

    ``subject`` names what was measured (the workload and its shape, e.g. "one JAT layer,
    6 heads x 64, batch 8"); each panel's title carries it, so each axis is labelled with
    what ran and its unit. Default: from the rows' kind (``bench jat``: "form" rows, or
    ``bench sparse``: "method" rows)."""
    # heavy: matplotlib, imported on use (bench.speed, which the benchmark's child
    # processes import, imports this module)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "method" if "method" in rows[0] else "form"
    if subject is None:
        subject = ("one JAT layer: official n^3 form vs efficient" if key == "form"
                   else "one attention layer: dense SDPA vs sparse pattern")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (("fwdbwd_ms", "forward + backward time (ms, log scale)", "time"),
              ("peak_mem_mb", "peak memory (MB, log scale)", "peak memory"))
    for ax, (field, label, what) in zip(axes, panels, strict=True):
        ax.set_title(f"{what}: {subject}", fontsize=9)
        for name in dict.fromkeys(r[key] for r in rows):
            pts = [(r["n"], r[field]) for r in rows
                   if r[key] == name and r.get(field) is not None and r[field] > 0]
            skipped = [r["n"] for r in rows if r[key] == name and r.get(field) is None]
            if pts:
                xs, ys = zip(*sorted(pts), strict=True)
                gone = f" (not run at n = {', '.join(map(str, skipped))})" if skipped else ""
                ax.plot(xs, ys, "o-", label=name + gone)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n (tokens, log scale)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return write_png(fig, path)


def write_png(fig: Any, path: str | Path) -> Path:
    """Save ``fig`` atomically at 120 dpi (the format from ``path``'s suffix) and close it."""
    path = Path(path)
    try:
        with atomic_path(path) as tmp:  # the temporary name keeps the suffix savefig reads
            fig.savefig(tmp, dpi=120)
    finally:
        import matplotlib.pyplot as plt  # imported on use, as above: CLI start-up

        plt.close(fig)
    return path


def env_title(env: dict[str, Any]) -> str:
    """A one-line plot title from ``bench.speed.environment()``."""
    where = env.get("gpu") or f"{env.get('cpu')} CPU, {env.get('threads')} thread(s)"
    return f"{where}; torch {env.get('torch')}; {env.get('date')}"
