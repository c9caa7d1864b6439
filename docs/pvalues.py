"""Recompute the Welch p values that docs/results.md quotes from the per-seed numbers in its
tables, for the comparisons whose run folders are not in the repository.

Each entry is (section, comparison, quoted p, seeds of A, seeds of B); the seeds are copied
from the table the text cites (rounded as printed there, so a recomputed p may differ from
the quoted one, computed from unrounded values, in the last digit). The test is
``attnlab.recipes.versus.welch_p`` (scipy's ``ttest_ind(equal_var=False)``), the one
``attnlab compare/collect --versus`` print. The script checks that each quoted p is within
0.01 of the recomputed one (exit status 1 otherwise) and that the per-seed numbers still
appear in results.md, so an edited table fails loudly.

    .venv/bin/python docs/pvalues.py
"""

from __future__ import annotations

import sys
from pathlib import Path

from attnlab.recipes.versus import welch_p

RESULTS = Path(__file__).resolve().parent / "results.md"
TOLERANCE = 0.01

FULL_COLA = [0.3138, 0.3609, 0.2766]  # full fine-tuning = the H100 CoLA baseline
FULL_MRPC = [0.8649, 0.8652, 0.8562]
DIFF_PRUNE_COLA = [0.3171, 0.2842, 0.2821]

# (section, comparison, quoted p, A per seed, B per seed)
QUOTED: list[tuple[str, str, float, list[float], list[float]]] = [
    ("CoLA placements", "JAT late vs JAT early", 0.14,
     [0.3386, 0.3452, 0.3229], [0.3233, 0.3145, 0.2809]),
    ("CoLA placements", "JAT late vs baseline", 0.53, [0.3386, 0.3452, 0.3229], FULL_COLA),
    ("CoLA placements", "BERT-JAT vs baseline", 0.89, [0.3288, 0.3129, 0.3209], FULL_COLA),
    ("CoLA placements", "JAT keep-last vs baseline", 0.67, [0.2765, 0.3323, 0.3024], FULL_COLA),
    ("CoLA placements", "JAT keep-last vs BERT-JAT", 0.40,
     [0.2765, 0.3323, 0.3024], [0.3288, 0.3129, 0.3209]),
    ("CoLA placements", "JAT keep-last vs JAT late", 0.18,
     [0.2765, 0.3323, 0.3024], [0.3386, 0.3452, 0.3229]),
    ("RTE", "BERT-JAT vs baseline", 0.78,
     [0.5740, 0.5884, 0.5668], [0.5776, 0.5993, 0.5632]),
    ("MRPC", "BERT-JAT vs baseline", 0.36, [0.8615, 0.8654, 0.8739], FULL_MRPC),
    ("STS-B", "BERT-JAT vs baseline", 0.44,
     [0.8521, 0.8541, 0.8569], [0.8546, 0.8587, 0.8547]),
    ("SST-2 8k", "BERT-JAT vs baseline", 0.12,
     [0.8647, 0.8601, 0.8612], [0.8658, 0.8635, 0.8670]),
    ("SQuAD", "BERT-JAT vs baseline, F1", 0.25,
     [52.35, 53.01, 54.40], [54.24, 53.61, 54.92]),
    ("SQuAD", "BERT-JAT vs baseline, EM", 0.47, [38.5, 38.5, 40.5], [40.0, 38.8, 40.8]),
    ("From scratch", "20%: JAT vs baseline", 0.73,
     [0.0630, 0.0536, 0.1017], [0.0690, 0.0534, 0.0774]),
    ("From scratch", "40%: JAT vs baseline", 0.72,
     [0.0985, 0.0704, 0.1210], [0.1216, 0.0717, 0.1228]),
    ("From scratch", "60%: JAT vs baseline", 0.84,
     [0.1063, 0.0821, 0.1456], [0.1025, 0.0934, 0.1559]),
    ("From scratch", "80%: JAT vs baseline", 1.00,
     [0.1029, 0.0900, 0.1201], [0.0921, 0.0956, 0.1251]),
    ("From scratch", "100%: JAT vs baseline", 0.55,
     [0.1238, 0.0899, 0.1425], [0.1147, 0.1461, 0.1309]),
    ("Diff-Prune CoLA", "vs full", 0.47, DIFF_PRUNE_COLA, FULL_COLA),
    ("Diff-Prune CoLA", "vs adapter", 0.43, DIFF_PRUNE_COLA, [0.2847, 0.0000, 0.3085]),
    ("Diff-Prune CoLA", "vs BitFit", 0.048, DIFF_PRUNE_COLA, [0.1961, 0.2028, 0.1008]),
    ("Diff-Prune CoLA", "vs LoRA", 0.065, DIFF_PRUNE_COLA, [0.2387, 0.1251, 0.1219]),
    ("Diff-Prune MRPC", "vs full", 0.34, [0.8610, 0.8700, 0.8687], FULL_MRPC),
]


def check(text: str) -> list[str]:
    """One line per comparison; lines starting with 'MISMATCH' or 'MISSING' are failures."""
    lines = []
    for section, what, quoted, a, b in QUOTED:
        p = welch_p(a, b)
        missing = [f"{v:.4f}".rstrip("0").rstrip(".") for v in a + b
                   if f"{v:.4f}" not in text and f"{v:.2f}" not in text
                   and f"{v:.1f}" not in text]
        ok = p is not None and abs(p - quoted) <= TOLERANCE
        tag = "ok" if ok and not missing else "MISSING" if missing else "MISMATCH"
        shown = "undefined" if p is None else f"{p:.3f}"
        lines.append(f"{tag:8} {section}: {what}: quoted p = {quoted}, recomputed {shown}"
                     + (f" (seeds not in results.md: {', '.join(missing)})" if missing else ""))
    return lines


def main() -> int:
    lines = check(RESULTS.read_text(encoding="utf-8"))
    print("\n".join(lines))
    return 0 if all(line.startswith("ok") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
