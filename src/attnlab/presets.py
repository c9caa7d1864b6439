"""Ready-made surgery plans from the papers, as plain rule dicts for ``Plan.parse``.

A preset is data, not behaviour: it returns the rules a user could have written in YAML,
so it can be printed, edited and saved next to a run.
"""

from __future__ import annotations

from typing import Any

from .core import resolve_config

# Official JAT default (github zhouhaoyi/JAT2022, ``--olayers 1,2,3,8,9,10``), 0-based.
JAT_LAYERS = (1, 2, 3, 8, 9, 10)


def jat_heads_of(jat_heads: int, num_heads: int) -> list[int]:
    """The heads the official code turns into JAT heads.

    Official rule (``CheckerNet.forward``: ``x[:, 0:use*2:2]`` if ``use <= 6`` else
    ``x[:, 0:use]``, written for 12 heads): the even heads 0, 2, 4, ... when
    jat_heads <= num_heads / 2, otherwise the first ``jat_heads`` heads.
    """
    if not 1 <= jat_heads <= num_heads:
        raise ValueError(
            f"jat_heads must be between 1 and num_heads={num_heads}, got {jat_heads}"
        )
    if 2 * jat_heads <= num_heads:
        return list(range(0, 2 * jat_heads, 2))
    return list(range(jat_heads))


def bert_jat(
    layers: tuple[int, ...] = JAT_LAYERS,
    jat_heads: int = 6,
    num_heads: int = 12,
    **jat_args: Any,
) -> list[dict[str, Any]]:
    """Plan rules putting Jump Self-attention on the official layers and heads of a BERT.

    ``jat_args`` are ``jat`` config fields (rho, coef, order, ...); they are checked at
    once, so a misspelt key raises here with the close matches. Returns
    ``[{"layers": [...], "heads": [...], "mechanism": "jat(...)"}]``; the default layers
    fit a 12-layer BERT-base, so pass ``layers=`` for smaller models (the embedded MiniLM
    has 6 layers).
    """
    cfg = resolve_config({"name": "jat", **jat_args})
    return [
        {
            "layers": sorted(set(layers)),
            "heads": jat_heads_of(jat_heads, num_heads),
            "mechanism": cfg.spec(),
        }
    ]
