"""apply_plan: put attention mechanisms into chosen layers and heads of a Hugging Face model.

``apply_plan(model, plan)`` validates the whole plan against every mechanism's
``Capabilities`` and the host model (layer/head counts, whole-layer scopes, maximum length,
causality) *before* it changes anything. Then, per layer, it installs the mechanisms as an
:class:`~attnlab.hf.backend.AttnlabLayer` submodule of the attention module (so mechanism
parameters save, load and train with the model), shrinks K/V projections for module-scope
mechanisms such as multi-query attention, and switches the model to the "attnlab" attention
function. It returns a :class:`SurgeryReport` (layer x head table of mechanisms).

``save_pretrained`` / ``load_pretrained`` live in :mod:`attnlab.hf.saving`, which imports this
module (never the other way round).
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Group
from rich.table import Table
from torch import nn

from ..core import HeadDims, MechanismConfig, mechanism_class
from .arch import Host, inspect_model
from .backend import (
    BACKEND,
    LAYER_ATTR,
    AttnlabLayer,
    ForwardState,
    install_reset_hook,
    register_backend,
)
from .plan import Plan, PlanError

SURGERY_ATTR = "_attnlab_surgery"  # base-model attribute: the applied (plan, report)


class SurgeryError(PlanError):
    """The plan does not fit this model; the message names the rule, the layer and the fix."""


# ------------------------------------------------------------------------------------ report


@dataclass
class SurgeryReport:
    """What a plan did to a model: the layer x head table of mechanisms and the cost."""

    model: str  # model class name
    model_type: str
    num_layers: int
    num_heads: int
    head_dim: int
    max_len: int | None  # HeadDims.max_len the mechanisms were built with
    table: list[list[str]]  # [layer][head] -> mechanism spec
    params_added: int  # parameters of the installed mechanisms
    params_removed: int  # parameters removed by shrinking K/V projections
    kv_heads: dict[int, int] = field(default_factory=dict)  # layer -> K/V heads after shrink
    plan: Plan = field(default_factory=Plan)

    @property
    def counts(self) -> dict[str, int]:
        """Heads per mechanism spec, most used first."""
        return dict(Counter(s for row in self.table for s in row).most_common())

    @property
    def counts_by_name(self) -> dict[str, int]:
        """Heads per mechanism name (``band(window=8)`` and ``band(window=64)`` together)."""
        names = Counter(s.split("(", 1)[0] for row in self.table for s in row)
        return dict(names.most_common())

    def labels(self) -> dict[str, str]:
        """Short table label for every spec: the name, or ``name#i`` if names repeat."""
        specs = list(dict.fromkeys(s for row in self.table for s in row))
        by_name: dict[str, list[str]] = {}
        for s in specs:
            by_name.setdefault(s.split("(", 1)[0], []).append(s)
        out = {}
        for name, group in by_name.items():
            for i, s in enumerate(group):
                out[s] = name if len(group) == 1 else f"{name}#{i + 1}"
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "max_len": self.max_len,
            "table": self.table,
            "counts": self.counts,
            "params_added": self.params_added,
            "params_removed": self.params_removed,
            "kv_heads": {str(k): v for k, v in self.kv_heads.items()},
            "plan": self.plan.to_list(),
        }

    def _legend(self) -> list[str]:
        counts = self.counts
        return [
            f"{lab}  ({counts[spec]} heads)" if lab == spec
            else f"{lab} = {spec}  ({counts[spec]} heads)"
            for spec, lab in self.labels().items()
        ]

    def __str__(self) -> str:
        labels = self.labels()
        width = max([len(v) for v in labels.values()] + [3])
        head = "layer | " + " ".join(f"h{h}".ljust(width) for h in range(self.num_heads))
        lines = [f"{self.model} ({self.num_layers} layers x {self.num_heads} heads, "
                 f"head dim {self.head_dim})", head, "-" * len(head)]
        for i, row in enumerate(self.table):
            cells = " ".join(labels[s].ljust(width) for s in row)
            kv = f"  [K/V heads: {self.kv_heads[i]}]" if i in self.kv_heads else ""
            lines.append(f"{str(i).rjust(5)} | {cells}{kv}")
        lines += ["", *self._legend(), self._params_line()]
        return "\n".join(lines)

    def _params_line(self) -> str:
        line = f"parameters added: {self.params_added:,}"
        if self.params_removed:
            line += f"; removed by K/V shrink: {self.params_removed:,}"
        return line

    def to_markdown(self) -> str:
        labels = self.labels()
        head = "| layer | " + " | ".join(f"h{h}" for h in range(self.num_heads)) + " |"
        sep = "|---" * (self.num_heads + 1) + "|"
        rows = [f"| {i} | " + " | ".join(labels[s] for s in row) + " |"
                for i, row in enumerate(self.table)]
        legend = [f"- `{lab}` = `{spec}` ({self.counts[spec]} heads)"
                  for spec, lab in labels.items()]
        return "\n".join([head, sep, *rows, "", *legend, "", self._params_line()])

    def __rich__(self):
        """Compact grid for terminals: one letter per distinct mechanism, then a legend."""
        specs = list(dict.fromkeys(s for row in self.table for s in row))
        letter = {spec: chr(ord("A") + i) if i < 26 else str(i) for i, spec in enumerate(specs)}
        t = Table(title=f"{self.model}: attention plan (layer x head)", box=None,
                  pad_edge=False)
        t.add_column("layer", justify="right")
        for h in range(self.num_heads):
            t.add_column(f"h{h}", justify="center", no_wrap=True)
        for i, row in enumerate(self.table):
            t.add_row(str(i), *(letter[s] for s in row))
        counts = self.counts
        legend = [f"  {letter[s]} = {s}  ({counts[s]} heads)" for s in specs]
        return Group(t, *legend, "  " + self._params_line())


# ----------------------------------------------------------------------------------- helpers


def _group_heads(heads: dict[int, tuple[MechanismConfig, int | None]]):
    """{head: (cfg, rule)} -> [(cfg, (heads...), rule)] ordered by first head."""
    groups: dict[MechanismConfig, list[int]] = {}
    rules: dict[MechanismConfig, int | None] = {}
    for h in sorted(heads):
        cfg, rule = heads[h]
        groups.setdefault(cfg, []).append(h)
        rules.setdefault(cfg, rule)
    return [(cfg, tuple(hs), rules[cfg]) for cfg, hs in groups.items()]


def _rule_text(plan: Plan, rule: int | None) -> str:
    if rule is None:
        return "default softmax"
    return f"plan rule {rule} ({plan.rules[rule].describe()})"


def _kv_heads_now(attn: nn.Module, host: Host) -> int:
    return getattr(attn, host.proj[1]).out_features // host.head_dim


def _validate(plan: Plan, host: Host, max_len: int | None):
    """Everything apply_plan checks before touching the model. Returns the per-layer groups."""
    table = plan.resolve_with_rules(host.num_layers, host.num_heads)
    layers = {}
    for layer, heads in table.items():
        groups = _group_heads(heads)
        for cfg, hs, rule in groups:
            caps = mechanism_class(cfg.name).caps
            where = f"{_rule_text(plan, rule)}, layer {layer}"
            if caps.scope in ("layer", "module") and len(groups) > 1:
                others = sorted(set(range(host.num_heads)) - set(hs))
                raise SurgeryError(
                    f"{where}: {cfg.name!r} has scope {caps.scope!r} (it mixes all heads of a "
                    f"layer) but heads {others} of layer {layer} get other mechanisms. Give it "
                    "heads: all, and make sure no later rule overrides part of that layer."
                )
            if caps.needs_max_len and max_len is None:
                raise SurgeryError(
                    f"{where}: {cfg.name!r} needs the model's maximum length, but "
                    f"{type(host.base).__name__}'s config has no max_position_embeddings; "
                    "pass apply_plan(..., max_len=N)"
                )
            if host.causal and not caps.causal_ok:
                raise SurgeryError(
                    f"{where}: the model is causal (a decoder) but {cfg.name!r} cannot be "
                    "causal (causal_ok=False). Use it on an encoder, or choose a mechanism "
                    "that supports causal attention."
                )
            if caps.kv_heads is not None and not host.fused:  # fused: no shrink (hf.fused)
                now = _kv_heads_now(host.attention[layer], host)
                if caps.scope != "module":
                    raise SurgeryError(
                        f"{where}: {cfg.name!r} declares kv_heads={caps.kv_heads} but scope "
                        f"{caps.scope!r}; a K/V shrink needs scope 'module' (fix the mechanism)"
                    )
                if now % caps.kv_heads:
                    raise SurgeryError(
                        f"{where}: {cfg.name!r} asks for {caps.kv_heads} K/V heads, which does "
                        f"not divide the layer's {now} K/V heads"
                    )
        layers[layer] = groups
    return layers


def _build(plan: Plan, host: Host, layers, max_len: int | None):
    """Build every mechanism (on the host's device/dtype) before changing the model."""
    ref = getattr(host.attention[0], host.proj[0]).weight
    built = {}
    for layer, groups in layers.items():
        mechs = []
        for cfg, hs, rule in groups:
            dims = HeadDims(num_heads=len(hs), head_dim=host.head_dim, max_len=max_len)
            try:
                mech = mechanism_class(cfg.name)(cfg, dims)
            except (ValueError, TypeError) as e:
                raise SurgeryError(
                    f"{_rule_text(plan, rule)}, layer {layer}, heads {list(hs)}: cannot build "
                    f"{cfg.spec()} for {dims}: {e}"
                ) from None
            mechs.append((hs, mech.to(device=ref.device, dtype=ref.dtype)))
        built[layer] = mechs
    _tie(built)
    return built


def _tie(built) -> None:
    """Call each mechanism class's optional ``tie(instances)`` once per config with every
    instance built from it, in layer order (cross-layer parameter sharing; see Mechanism)."""
    by_cfg: dict[MechanismConfig, list[nn.Module]] = {}
    for mechs in built.values():
        for _, mech in mechs:
            by_cfg.setdefault(mech.cfg, []).append(mech)
    for instances in by_cfg.values():
        tie = getattr(type(instances[0]), "tie", None)
        if tie is not None:
            tie(instances)


def _shrink_linear(lin: nn.Linear, heads_now: int, kv_heads: int, head_dim: int) -> nn.Linear:
    """K/V projection with ``kv_heads`` heads: each new head is the mean of the old heads of
    its group (the GQA/MQA up-training initialisation of Ainslie et al. 2023)."""
    group = heads_now // kv_heads
    new = nn.Linear(lin.in_features, kv_heads * head_dim, bias=lin.bias is not None,
                    device=lin.weight.device, dtype=lin.weight.dtype)
    with torch.no_grad():
        w = lin.weight.view(kv_heads, group, head_dim, lin.in_features).mean(1)
        new.weight.copy_(w.reshape(kv_heads * head_dim, lin.in_features))
        if lin.bias is not None:
            new.bias.copy_(lin.bias.view(kv_heads, group, head_dim).mean(1).reshape(-1))
    new.weight.requires_grad_(lin.weight.requires_grad)
    return new


def _own_config(model: nn.Module) -> None:
    """Give the model its own config object before switching its attention implementation:
    models built from one config object share ``_attn_implementation``, so switching one
    would switch the other."""
    old = getattr(model, "config", None)
    if old is None:
        return
    new = copy.deepcopy(old)
    for mod in model.modules():
        if getattr(mod, "config", None) is old:
            mod.config = new


def switch_to_attnlab(model: nn.Module, host: Host) -> None:
    """Register the "attnlab" attention function and make ``model`` call it (on a config of
    its own). Heads without installed mechanisms then run plain softmax."""
    register_backend()
    _own_config(model)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(BACKEND)  # type: ignore[operator]  # HF method
    else:
        host.base.set_attn_implementation(BACKEND)


# -------------------------------------------------------------------------------- apply_plan


def apply_plan(model: nn.Module, plan: Any, *, max_len: int | None = None) -> SurgeryReport:
    """Install ``plan`` (anything :meth:`Plan.parse` takes) into ``model``; see module doc.

    max_len: ``HeadDims.max_len`` for the mechanisms (default: the model's
    ``max_position_embeddings``); set it lower to size length-bound mechanisms such as
    Linformer for the sequence length you train with. Re-applying a plan replaces the
    previous mechanisms, except after a K/V shrink (which cannot be undone).
    """
    plan = Plan.parse(plan)
    host = inspect_model(model)
    if max_len is None:
        max_len = host.max_len
    elif max_len < 1 or (host.max_len is not None and max_len > host.max_len):
        raise SurgeryError(
            f"max_len={max_len} must be between 1 and the model's maximum length {host.max_len}"
        )
    for layer, attn in enumerate(host.attention):
        old = getattr(attn, LAYER_ATTR, None)
        if isinstance(old, AttnlabLayer) and old.kv_heads is not None:
            names = ", ".join(old.names())
            raise SurgeryError(
                f"layer {layer}'s K/V projections were shrunk to {old.kv_heads} heads by "
                f"{names!r}, which cannot be undone; apply the new plan to a freshly loaded "
                "model instead"
            )
    layers = _validate(plan, host, max_len)
    built = _build(plan, host, layers, max_len)

    # -- nothing has changed so far; from here on the model is modified --------------------
    switch_to_attnlab(model, host)
    holder = ForwardState()
    params_added = params_removed = 0
    counted: set[int] = set()
    kv_by_layer: dict[int, int] = {}
    for layer, attn in enumerate(host.attention):
        groups = built[layer]
        kv = None
        if len(groups) == 1 and not host.fused:  # a fused Q/K/V projection is never shrunk
            kv = getattr(groups[0][1].caps, "kv_heads", None)
        if kv is not None:
            now = _kv_heads_now(attn, host)
            for name in host.proj[1:]:
                lin = getattr(attn, name)
                setattr(attn, name, _shrink_linear(lin, now, kv, host.head_dim))
                params_removed += sum(p.numel() for p in lin.parameters()) - sum(
                    p.numel() for p in getattr(attn, name).parameters())
            kv_by_layer[layer] = kv
        new = AttnlabLayer(layer, host.num_heads, groups, holder, kv_heads=kv)
        setattr(attn, LAYER_ATTR, new)
        params_added += sum(p.numel() for p in new.parameters() if id(p) not in counted)
        counted.update(id(p) for p in new.parameters())  # tied parameters count once
    install_reset_hook(host.base, holder)

    report = SurgeryReport(
        model=type(model).__name__,
        model_type=host.model_type,
        num_layers=host.num_layers,
        num_heads=host.num_heads,
        head_dim=host.head_dim,
        max_len=max_len,
        table=[getattr(a, LAYER_ATTR).head_table() for a in host.attention],
        params_added=params_added,
        params_removed=params_removed,
        kv_heads=kv_by_layer,
        plan=plan,
    )
    setattr(host.base, SURGERY_ATTR, report)
    return report


def applied_report(model: nn.Module) -> SurgeryReport | None:
    """The SurgeryReport of the plan last applied to ``model`` (None if none was)."""
    for mod in model.modules():
        rep = getattr(mod, SURGERY_ATTR, None)
        if isinstance(rep, SurgeryReport):
            return rep
    return None
