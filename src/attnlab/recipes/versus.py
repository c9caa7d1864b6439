"""``--versus LABEL`` of ``attnlab compare`` / ``collect``: each row against a reference row.

Adds to every row the difference of means to the reference (``delta``, in the metric's
units) and the two-sided p-value of Welch's t-test over the seeds (``p_welch``,
``scipy.stats.ttest_ind(..., equal_var=False)``): the test the result tables of this
project quote, e.g. "BERT-JAT vs baseline, 3 seeds each: p = 0.78". The p-value is None
where it is undefined: the reference row itself, fewer than 2 seeds on either side, or no
spread on both sides. With 3 seeds a t-test has little power; read p as "how surprising
would this gap be from seed noise alone", not as a verdict.
"""

from __future__ import annotations

import math
from typing import Any

from ..config import ConfigError


def welch_p(a: list[float], b: list[float]) -> float | None:
    """Two-sided Welch t-test p-value of two samples; None where it is undefined."""
    from scipy.stats import ttest_ind  # heavy: scipy.stats (~0.5 s), imported on use

    a = [x for x in a if x is not None and not math.isnan(x)]
    b = [x for x in b if x is not None and not math.isnan(x)]
    if len(a) < 2 or len(b) < 2 or (max(a) == min(a) and max(b) == min(b)):
        return None  # no variance on one side, or no spread on either: t is undefined
    p = float(ttest_ind(a, b, equal_var=False).pvalue)
    return None if math.isnan(p) else p


def check_reference(labels: list[str], reference: str) -> None:
    """ConfigError naming the rows when ``reference`` is not one of ``labels``."""
    if reference not in labels:
        raise ConfigError(f"--versus {reference!r}: no such row; the rows are "
                          f"{', '.join(repr(x) for x in labels)}")


def add_versus(rows: list[dict[str, Any]], reference: str) -> list[dict[str, Any]]:
    """Rows with ``versus`` (the reference's label), ``is_reference``, ``delta`` (mean -
    reference mean) and ``p_welch`` added. ``reference`` is a row's variant label, exactly
    as in the table (the first row of that label where several share it)."""
    labels = [r["variant"] for r in rows]
    check_reference(labels, reference)
    ref = rows[labels.index(reference)]
    out = []
    for r in rows:
        is_ref = r is ref
        out.append({**r, "versus": reference, "is_reference": is_ref,
                    "delta": 0.0 if is_ref else r["mean"] - ref["mean"],
                    "p_welch": None if is_ref else welch_p(r["values"], ref["values"])})
    return out


def versus_cells(row: dict[str, Any]) -> str:
    """The two Markdown cells ``| +0.0036 | 0.78 |`` of a row (``-`` for the reference, and
    for an undefined p)."""
    if row.get("is_reference"):
        return " (reference) | - |"
    p = row["p_welch"]
    p_text = "-" if p is None else (f"{p:.2g}" if p >= 0.001 else "< 0.001")
    return f" {row['delta']:+.4f} | {p_text} |"
