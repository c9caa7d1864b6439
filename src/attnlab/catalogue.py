"""The mechanism catalogue, built from the registry (``attnlab ls``, docs/mechanisms.md)."""

from __future__ import annotations

from .core import list_mechanisms, mechanism_class


def catalogue_rows() -> list[dict]:
    """One dict per registered mechanism: name, declared capabilities, default spec, summary."""
    rows = []
    for name in list_mechanisms():
        cls = mechanism_class(name)
        caps = cls.caps
        doc = (cls.__doc__ or "").strip().splitlines()
        rows.append({
            "name": name,
            "family": caps.family,
            "scope": caps.scope,
            "complexity": caps.complexity,
            "exact": caps.exact,
            "causal_ok": caps.causal_ok,
            "key_mask_ok": caps.key_mask_ok,
            "needs_max_len": caps.needs_max_len,
            "paper": caps.paper,
            "spec": cls.config_cls().spec(),
            "summary": doc[0] if doc else "",
        })
    return rows


def catalogue_markdown() -> str:
    """docs/mechanisms.md: regenerate with ``attnlab ls --markdown > docs/mechanisms.md``."""
    lines = [
        "# Mechanism catalogue",
        "",
        "Generated from the registry by `attnlab ls --markdown`; do not edit by hand.",
        "",
        "| name | family | scope | complexity | exact | causal | paper | default spec |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in catalogue_rows():
        lines.append(
            f"| `{r['name']}` | {r['family']} | {r['scope']} | {r['complexity']} | "
            f"{'yes' if r['exact'] else 'no'} | {'yes' if r['causal_ok'] else 'no'} | "
            f"{r['paper']} | `{r['spec']}` |"
        )
    lines += ["", "## Summaries", ""]
    for r in catalogue_rows():
        lines.append(f"- **{r['name']}**: {r['summary']}")
    return "\n".join(lines) + "\n"
