"""Scaling curves of a benchmark's rows: time and peak memory against length, log-log.

One line per method (``bench sparse``: "sdpa", "band(window=128)", ...; ``bench jat``:
"naive", "efficient"); points a method skipped (None) are left out, so a line stops where a
method no longer fits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def scaling_plot(rows: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Write a two-panel PNG (fwd+bwd time, peak memory vs n) for benchmark ``rows``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "method" if "method" in rows[0] else "form"
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    panels = (("fwdbwd_ms", "forward + backward (ms)"), ("peak_mem_mb", "peak memory (MB)"))
    for ax, (field, label) in zip(axes, panels, strict=True):
        for name in dict.fromkeys(r[key] for r in rows):
            pts = [(r["n"], r[field]) for r in rows
                   if r[key] == name and r.get(field) is not None and r[field] > 0]
            if pts:
                xs, ys = zip(*sorted(pts), strict=True)
                ax.plot(xs, ys, "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
    return path


def env_title(env: dict[str, Any]) -> str:
    """A one-line plot title from ``bench.speed.environment()``."""
    where = env.get("gpu") or f"{env.get('cpu')} CPU, {env.get('threads')} thread(s)"
    return f"{where}; torch {env.get('torch')}; {env.get('date')}"
