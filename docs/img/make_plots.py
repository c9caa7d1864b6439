"""Redraw the committed plots in docs/img from the numbers in the docs' tables.

The runs behind these plots (runs/, git-ignored) are not in the repository, so each plot is
drawn from the table it illustrates in docs/results.md (docs/benchmarks-history.md for the JAT
benchmark on the H100); the numbers below are copied from those tables, and the script checks that
each one still appears in its document before drawing (a table edited without the plot
fails loudly). Drawing code: ``attnlab.recipes.figures`` (the functions ``attnlab
compare`` and ``attnlab collect`` use) and ``attnlab.bench.plots.scaling_plot``.

    .venv/bin/python docs/img/make_plots.py               # every plot
    .venv/bin/python docs/img/make_plots.py tuners-matrix  # one plot (name = file stem)
    .venv/bin/python docs/img/make_plots.py --matrix-table  # the tuner matrix, Markdown
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attnlab.analysis.plots import figure_bytes
from attnlab.bench.plots import scaling_plot
from attnlab.io import atomic_write
from attnlab.recipes import figures

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent
MINILM = "all-MiniLM-L6-v2"
DPI = 110


def row(variant: str, mean: float, std: float | None, values: list[float | None]) -> dict:
    seeds = sum(v is not None for v in values)
    return {"variant": variant, "mean": mean, "std": std, "seeds": seeds, "values": values}


# --------------------------------------------------------------------- docs/results.md tables

# "BERT-JAT with the paper's recipe on an H100": CoNLL-2003 table (entity F1, 3 seeds)
CONLL_JAT = [
    row("baseline", 0.9079, 0.0017, [0.9061, 0.9095, 0.9080]),
    row("BERT-JAT", 0.9065, 0.0025, [0.9044, 0.9094, 0.9058]),
]
# the CoLA baseline of that section (3 seeds, H100)
COLA_BASELINE = row("baseline", 0.3171, 0.0422, [0.3138, 0.3609, 0.2766])
# "CoLA: the whole rho grid": seed 0, rho 4.0-6.5 on the H100, 7.0-10.0 on the CPU
RHO_GRID = [(4.0, 0.3176, "H100"), (4.5, 0.3267, "H100"), (5.0, 0.3288, "H100"),
            (5.5, 0.3045, "H100"), (6.0, 0.3169, "H100"), (6.5, 0.3278, "H100"),
            (7.0, 0.2979, "CPU"), (7.5, 0.2984, "CPU"), (8.0, 0.3007, "CPU"),
            (8.5, 0.2945, "CPU"), (9.0, 0.2976, "CPU"), (9.5, 0.3007, "CPU"),
            (10.0, 0.3060, "CPU")]
# "3 seeds at rho = 5.0 and the layer placements"
PLACEMENTS = [
    COLA_BASELINE,
    row("BERT-JAT, layers 0, 1, 4, 5", 0.3209, 0.0080, [0.3288, 0.3129, 0.3209]),
    row("JAT early, layers 0, 1, 2", 0.3062, 0.0224, [0.3233, 0.3145, 0.2809]),
    row("JAT late, layers 3, 4, 5", 0.3356, 0.0114, [0.3386, 0.3452, 0.3229]),
    row("JAT keep-last, layers 0, 1, 3, 4", 0.3037, 0.0279, [0.2765, 0.3323, 0.3024]),
]
# "Training from scratch with and without JAT heads": % of CoLA train -> (mean, std, seeds)
SCRATCH = {
    "baseline": [(20, 0.0666, 0.0122, [0.0690, 0.0534, 0.0774]),
                 (40, 0.1054, 0.0292, [0.1216, 0.0717, 0.1228]),
                 (60, 0.1173, 0.0337, [0.1025, 0.0934, 0.1559]),
                 (80, 0.1043, 0.0181, [0.0921, 0.0956, 0.1251]),
                 (100, 0.1306, 0.0157, [0.1147, 0.1461, 0.1309])],
    "with JAT heads (layers 1-2)": [(20, 0.0728, 0.0255, [0.0630, 0.0536, 0.1017]),
                                    (40, 0.0966, 0.0253, [0.0985, 0.0704, 0.1210]),
                                    (60, 0.1113, 0.0320, [0.1063, 0.0821, 0.1456]),
                                    (80, 0.1044, 0.0151, [0.1029, 0.0900, 0.1201]),
                                    (100, 0.1187, 0.0267, [0.1238, 0.0899, 0.1425])],
}
# "CoLA, 10 epochs" tuner table
TUNERS_COLA = [
    row("full (5 epochs)", 0.3171, 0.0422, [0.3138, 0.3609, 0.2766]),
    row("adapter", 0.1977, 0.1716, [0.2847, 0.0000, 0.3085]),
    row("LoRA", 0.1619, 0.0665, [0.2387, 0.1251, 0.1219]),
    row("prefix", 0.1128, 0.0869, [0.1914, 0.1276, 0.0194]),
    row("PASTA", 0.0965, 0.0541, [0.1186, 0.1361, 0.0348]),
    row("BitFit", 0.1665, 0.0571, [0.1961, 0.2028, 0.1008]),
    row("Diff-Prune (3 + 3 epochs)", 0.2944, 0.0196, [0.3171, 0.2842, 0.2821]),
]
# "The matrix: 7 tuners x 6 tasks" (mean ± std of 3 seeds; None: not run)
MATRIX_TASKS = [("cola", "CoLA", "MCC"), ("sst2", "SST-2 8k", "accuracy"),
                ("mrpc", "MRPC", "F1"), ("rte", "RTE", "accuracy"),
                ("stsb", "STS-B", "Spearman"), ("conll2003", "CoNLL-2003", "entity F1")]
MATRIX = {  # tuner -> one (mean, std) per task, in MATRIX_TASKS order
    "full": [(0.3171, 0.0422), (0.8601, 0.0057), (0.8621, 0.0051), (0.5800, 0.0182),
             (0.8560, 0.0023), (0.9079, 0.0017)],
    "PASTA": [(0.0965, 0.0541), (0.8188, 0.0064), (0.8454, 0.0053), (0.5475, 0.0021),
              (0.8256, 0.0027), (0.7779, 0.0010)],
    "BitFit": [(0.1665, 0.0571), (0.8364, 0.0013), (0.8727, 0.0171), (0.5475, 0.0110),
               (0.8509, 0.0047), (0.8216, 0.0011)],
    "adapter": [(0.1977, 0.1716), (0.8563, 0.0007), (0.8747, 0.0044), (0.6137, 0.0201),
                (0.3950, 0.4148), (0.8849, 0.0030)],
    "LoRA": [(0.1619, 0.0665), (0.8475, 0.0053), (0.8684, 0.0096), (0.5848, 0.0063),
             (0.8325, 0.0305), (0.8622, 0.0002)],
    "prefix": [(0.1128, 0.0869), (0.8463, 0.0030), (0.8346, 0.0046), (0.5487, 0.0165),
               (0.8461, 0.0057), (0.8243, 0.0007)],
    "Diff-Prune": [(0.2944, 0.0196), None, (0.8666, 0.0049), None, None, None],
}
MATRIX_TRAINED = {"full": "100%", "PASTA": "0.020-0.030%", "BitFit": "0.114-0.115%",
                  "adapter": "1.039-1.046%", "LoRA": "0.325-0.327%", "prefix": "0.406-0.408%",
                  "Diff-Prune": "0.500% kept"}
MATRIX_HEADING, MATRIX_END = "### The matrix: 7 tuners x 6 tasks", "What the matrix shows"


def matrix_markdown() -> str:
    """The matrix as the Markdown table of docs/results.md (cells: mean ± std)."""
    short = {"accuracy": "acc.", "entity F1": "F1"}
    head = ("| | " + " | ".join(f"{label} ({short.get(unit, unit)})"
                                for _, label, unit in MATRIX_TASKS)
            + " | trained (% backbone) |\n|" + "---|" * (len(MATRIX_TASKS) + 2) + "\n")
    body = "".join(
        f"| {tuner} | " + " | ".join("-" if c is None else f"{c[0]:.4f} ± {c[1]:.4f}"
                                     for c in cells) + f" | {MATRIX_TRAINED[tuner]} |\n"
        for tuner, cells in MATRIX.items())
    return head + body


def matrix_cells_elsewhere(text: str) -> list[str]:
    """Matrix cells that no per-task table shows (searched outside the matrix's section)."""
    start, end = text.index(MATRIX_HEADING), text.index(MATRIX_END)
    outside = text[:start] + text[end:]
    cells = [f"{c[0]:.4f} ± {c[1]:.4f}" for cells in MATRIX.values() for c in cells if c]
    return [c for c in cells if c not in outside]

# ------------------------------------------------------- docs/benchmarks-history.md table

# "On an H100 GPU": n, form, fwd+bwd ms, peak MB fwd+bwd (None: skipped, n^3 too large)
BENCH_JAT_H100 = [(128, "naive", 5, 774), (128, "efficient", 8, 102),
                  (256, "naive", 20, 6168), (256, "efficient", 7, 352),
                  (512, "naive", None, None), (512, "efficient", 62, 536),
                  (1024, "naive", None, None), (1024, "efficient", 193, 1465),
                  (2048, "efficient", 1651, 5812)]


# ----------------------------------------------------------------------------------- plots


def _save(fig: Any, name: str) -> Path:
    return atomic_write(HERE / f"{name}.png", figure_bytes(fig, "png", dpi=DPI))


def jat_conll2003_h100() -> Path:
    fig = figures.seed_plot(CONLL_JAT, task="CoNLL-2003 (valid)", model=f"{MINILM}, H100",
                            metric="entity F1", unit="0-1")
    return _save(fig, "jat-conll2003-h100")


def _rho_points(devices: tuple[str, ...]) -> list[dict]:
    return [{"x": x, "y": y, "group": d} for x, y, d in RHO_GRID if d in devices]


def jat_cola_rho_grid_h100() -> Path:
    fig = figures.grid_plot(_rho_points(("H100",)), param="seed 0", task="CoLA dev",
                            model=f"{MINILM}, H100", metric="MCC", baseline=COLA_BASELINE,
                            xlabel="JAT rho")
    return _save(fig, "jat-cola-rho-grid-h100")


def jat_cola_rho_grid() -> Path:
    fig = figures.grid_plot(_rho_points(("H100", "CPU")), param="seed 0",
                            task="CoLA dev", model=MINILM, metric="MCC",
                            baseline=dict(COLA_BASELINE, variant="baseline (H100)"),
                            chosen=5.0, xlabel="JAT rho")
    return _save(fig, "jat-cola-rho-grid")


def jat_cola_placements() -> Path:
    fig = figures.seed_plot(PLACEMENTS, task="CoLA dev", model=f"{MINILM} (baseline H100, "
                            "JAT rows H100/CPU)", metric="MCC")
    return _save(fig, "jat-cola-placements")


def jat_scratch_cola_fractions() -> Path:
    series = {name: [{"x": x, "mean": m, "std": s, "values": v} for x, m, s, v in pts]
              for name, pts in SCRATCH.items()}
    fig = figures.sweep_plot(series, xlabel="training data (% of the CoLA training sentences)",
                             task="CoLA dev", model="small encoder from scratch (4 layers, "
                             "8 heads, hidden 512)", metric="MCC")
    return _save(fig, "jat-scratch-cola-fractions")


def tuners_cola() -> Path:
    fig = figures.seed_plot(TUNERS_COLA, task="CoLA dev", model=f"{MINILM}, 10 epochs",
                            metric="MCC")
    return _save(fig, "tuners-cola")


def tuners_matrix() -> Path:
    cells: dict[tuple[str, str], dict | None] = {}
    for tuner, per_task in MATRIX.items():
        for (key, _, _), cell in zip(MATRIX_TASKS, per_task, strict=True):
            cells[(tuner, key)] = None if cell is None else {
                "variant": tuner, "mean": cell[0], "std": cell[1], "seeds": 3, "values": []}
    fig = figures.matrix_plot(cells, rows=list(MATRIX), tasks=MATRIX_TASKS, model=MINILM,
                              title="Tuners x tasks: dev metric, mean ± std over 3 seeds")
    return _save(fig, "tuners-matrix")


def bench_jat_h100() -> Path:
    rows = [{"n": n, "form": form, "fwdbwd_ms": ms, "peak_mem_mb": mb}
            for n, form, ms, mb in BENCH_JAT_H100]
    return scaling_plot(rows, HERE / "bench-jat-h100.png",
                        title="NVIDIA H100 80GB HBM3; torch 2.11.0+cu130; 2026-11-22 16:40 UTC",
                        subject="one JAT layer, 6 heads x 64, batch 8, rho 5 (fp32)")


PLOTS: dict[str, tuple[Callable[[], Path], str, list[float]]] = {
    "jat-conll2003-h100": (jat_conll2003_h100, "results.md",
                           [v for r in CONLL_JAT for v in [r["mean"], *r["values"]]]),
    "jat-cola-rho-grid-h100": (jat_cola_rho_grid_h100, "results.md",
                               [y for _, y, d in RHO_GRID if d == "H100"]),
    "jat-cola-rho-grid": (jat_cola_rho_grid, "results.md", [y for _, y, _ in RHO_GRID]),
    "jat-cola-placements": (jat_cola_placements, "results.md",
                            [v for r in PLACEMENTS for v in [r["mean"], r["std"], *r["values"]]]),
    "jat-scratch-cola-fractions": (jat_scratch_cola_fractions, "results.md",
                                   [v for pts in SCRATCH.values() for _, m, s, vals in pts
                                    for v in (m, s, *vals)]),
    "tuners-cola": (tuners_cola, "results.md",
                    [v for r in TUNERS_COLA for v in [r["mean"], r["std"], *r["values"]]]),
    "tuners-matrix": (tuners_matrix, "results.md",
                      [v for cells in MATRIX.values() for c in cells if c for v in c]),
    "bench-jat-h100": (bench_jat_h100, "benchmarks-history.md",
                       [v for r in BENCH_JAT_H100 for v in r[2:] if v is not None]),
}


def check_numbers(name: str) -> list[str]:
    """The plot's numbers that its document no longer shows (4 decimals, or integers)."""
    _, doc, numbers = PLOTS[name]
    text = (DOCS / doc).read_text(encoding="utf-8")
    shown = [f"{v:.4f}" if isinstance(v, float) else f"| {v} |" for v in numbers]
    return [s for s in shown if s not in text]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help=f"plots to draw (default all): {', '.join(PLOTS)}")
    ap.add_argument("--matrix-table", action="store_true",
                    help="print the tuner matrix of docs/results.md from the per-task cells "
                         "(each checked against its task's table) instead of drawing")
    args = ap.parse_args(argv)
    if args.matrix_table:
        orphans = matrix_cells_elsewhere((DOCS / "results.md").read_text(encoding="utf-8"))
        if orphans:
            print(f"not in any per-task table of docs/results.md: {orphans}", file=sys.stderr)
            return 1
        print(matrix_markdown(), end="")
        return 0
    unknown = [n for n in args.names if n not in PLOTS]
    if unknown:
        ap.error(f"unknown plot(s) {unknown}; choose from {', '.join(PLOTS)}")
    failed = False
    for name in args.names or list(PLOTS):
        missing = check_numbers(name)
        if missing:
            print(f"{name}: not drawn: docs/{PLOTS[name][1]} no longer shows {missing}; "
                  "update the numbers here from its table", file=sys.stderr)
            failed = True
            continue
        print(f"wrote {PLOTS[name][0]().relative_to(DOCS.parent)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
