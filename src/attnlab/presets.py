"""Named plans and presets: the one home of ready-made surgery plans.

- ``NAMED_PLANS``: plans by name for ``plan=NAME`` (``attnlab run``, ``validate``,
  ``compare --vary plan=...``; ``attnlab ls --plans`` lists them), as compact rules
  ``LAYERS:HEADS:SPEC``. :func:`plan_value` turns a ``plan=`` value (a name, a name with
  arguments such as ``jat(rho=4.5)``, or ';'-joined rules) into those rules.
- Presets from the papers (:func:`bert_jat`), functions returning plain rule dicts.

A preset is data, not behaviour: it returns the rules a user could have written in YAML,
so it can be printed, edited and saved next to a run.
"""

from __future__ import annotations

from typing import Any

from .core import RegistryError, parse_spec, resolve_config

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

    The heads follow the official selection rule (:func:`jat_heads_of`); their number,
    ``jat_heads=6`` of 12, is this preset's default, not the official code's: its
    ``oheads=10`` default leaves ``use = 12 - 10 = 2`` JAT heads (0 and 2), which is
    ``jat_heads=2``.

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


# ----------------------------------------------------------------------------- named plans

NAMED_PLANS: dict[str, list[str]] = {
    "baseline": [],
    "band16": ["all:all:band(window=16)"],
    "band32": ["all:all:band(window=32)"],
    "band64": ["all:all:band(window=64)"],
    "longformer32": ["all:all:longformer(window=32, global_tokens=[0])"],
    "bigbird": ["all:all:bigbird(block=16, window_blocks=3, num_random_blocks=1)"],
    "linear": ["all:all:linear_elu"],
    "linformer64": ["all:all:linformer(k=64)"],
    # BERT-JAT scaled to the 6-layer MiniLM: layers {1,2,3,8,9,10} of 12 -> {0,1,4,5} of 6,
    # JAT on the even heads (6 of 12), the paper's rho=5 and coef=0.5 (docs/results.md).
    "jat": ["0,1,4,5:0,2,4,6,8,10:jat(rho=5.0, coef=0.5)"],
    # the paper's other placements, as halves of the 6-layer model
    "jat_early": ["0,1,2:0,2,4,6,8,10:jat(rho=5.0, coef=0.5)"],
    "jat_late": ["3,4,5:0,2,4,6,8,10:jat(rho=5.0, coef=0.5)"],
    # the paper's default keeps the last of 12 layers vanilla ({1,2,3,8,9,10}); of 6 layers,
    # layers {0,1,3,4} keep the final layer vanilla as well
    "jat_keep_last": ["0,1,3,4:0,2,4,6,8,10:jat(rho=5.0, coef=0.5)"],
    # the same for encoder_config("small") (4 layers x 8 heads): middle layers, even heads
    "jat_small": ["1,2:0,2,4,6:jat(rho=5.0, coef=0.5)"],
}


def plan_value(value: str) -> list[str]:
    """A named plan, a named plan with arguments (``jat(rho=4.5)``), or ';'-joined rules."""
    value = value.strip()
    if value in NAMED_PLANS:
        return NAMED_PLANS[value]
    if ":" in value:
        return [r for r in value.split(";") if r.strip()]
    name = value.split("(", 1)[0].strip()
    if "(" in value and name in NAMED_PLANS:
        if not NAMED_PLANS[name]:
            raise RegistryError(f"plan {value!r}: {name!r} gives no head a mechanism, so it "
                                f"takes no arguments; write plan={name}")
        return _with_args(name, value)
    raise RegistryError(f"unknown plan {value!r}; use one of {', '.join(NAMED_PLANS)} "
                        "(optionally with arguments, e.g. jat(rho=4.5)) or rules like "
                        "'0-2:all:band(window=8)'")


def _with_args(name: str, value: str) -> list[str]:
    """Rules of the named plan ``name`` with the arguments of ``value`` merged into each spec."""
    _, args = parse_spec(value, "plan", "jat(rho=4.5)")
    rules = []
    for rule in NAMED_PLANS[name]:
        layers, heads, spec = rule.split(":", 2)
        mech, old = parse_spec(spec)
        merged = {**old, **args}
        rules.append(f"{layers}:{heads}:{mech}("
                     + ", ".join(f"{k}={v!r}" for k, v in merged.items()) + ")")
    return rules
