"""apply_plan: put attention mechanisms into chosen layers and heads of a Hugging Face model.

``apply_plan(model, plan)`` validates the whole plan against every mechanism's
``Capabilities`` and the host model (layer/head counts, whole-layer scopes, maximum length,
causality) *before* it changes anything. Then, per layer, it installs the mechanisms as an
:class:`~attnlab.hf.backend.AttnlabLayer` submodule of the attention module (so mechanism
parameters save, load and train with the model), shrinks K/V projections for module-scope
mechanisms such as multi-query attention (``caps.kv_heads``), re-sizes the heads of
``head_size`` (``caps.head_dims``: Q/K/V projections and the output projection's input;
BERT layout and DistilBERT), and switches the model to the "attnlab"
attention function. It returns a :class:`SurgeryReport` (layer x head table of mechanisms).
A module-scope mechanism with an ``adopt_projections(query, key)`` method (``collaborative``) is
handed the layer's query and key projections and returns the ones that replace them
(converted from the pretrained weights); fused Q/K/V hosts are refused for it.

``save_pretrained`` / ``load_pretrained`` live in :mod:`attnlab.hf.saving`, which imports this
module (never the other way round).
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from rich.console import Group
from rich.table import Table
from torch import nn

from ..core import Capabilities, HeadDims, MechanismConfig, mechanism_class
from .arch import FAMILIES, Host, inspect_model
from .backend import (
    BACKEND,
    LAYER_ATTR,
    AttnlabLayer,
    ForwardState,
    install_reset_hook,
    register_backend,
)
from .plan import Plan, PlanError
from .unread import unread_layers

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
    params_added: int  # parameters of the installed mechanisms and of enlarged heads
    params_removed: int  # parameters removed by shrinking K/V projections or heads
    kv_heads: dict[int, int] = field(default_factory=dict)  # layer -> K/V heads after shrink
    head_dims: dict[int, tuple[int, int]] = field(default_factory=dict)  # layer -> (dk, dv)
    plan: Plan = field(default_factory=Plan)
    # layer -> the projections no head of it reads ("query", "key"; ``hf.unread``)
    unread: dict[int, tuple[str, ...]] = field(default_factory=dict)

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
            "head_dims": {str(k): list(v) for k, v in self.head_dims.items()},
            "plan": self.plan.to_list(),
            "unread": {str(k): list(v) for k, v in self.unread.items()},
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
            if i in self.head_dims:
                kv += "  [head dims: dk={}, dv={}]".format(*self.head_dims[i])
            lines.append(f"{str(i).rjust(5)} | {cells}{kv}")
        lines += ["", *self._legend(), self._params_line(), *self._unread_lines()]
        return "\n".join(lines)

    def _params_line(self) -> str:
        line = f"parameters added: {self.params_added:,}"
        if self.params_removed:
            line += f"; removed by K/V or head shrink: {self.params_removed:,}"
        return line

    def _unread_lines(self) -> list[str]:
        """One line naming the projections no head reads, or none."""
        if not self.unread:
            return []
        where = "; ".join(f"layer {i}: {'/'.join(r)}" for i, r in sorted(self.unread.items()))
        return [f"not read by any head (no gradient from the task loss): {where}"]

    def to_markdown(self) -> str:
        labels = self.labels()
        head = "| layer | " + " | ".join(f"h{h}" for h in range(self.num_heads)) + " |"
        sep = "|---" * (self.num_heads + 1) + "|"
        rows = [f"| {i} | " + " | ".join(labels[s] for s in row) + " |"
                for i, row in enumerate(self.table)]
        legend = [f"- `{lab}` = `{spec}` ({self.counts[spec]} heads)"
                  for spec, lab in labels.items()]
        return "\n".join([head, sep, *rows, "", *legend, "", self._params_line(),
                          *self._unread_lines()])

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
        return Group(t, *legend, "  " + self._params_line(),
                     *("  " + line for line in self._unread_lines()))


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
            if host.fused and hasattr(mechanism_class(cfg.name), "adopt_projections"):
                raise SurgeryError(
                    f"{where}: {cfg.name!r} replaces the query and key projections, but "
                    f"{type(host.base).__name__} has one fused Q/K/V projection; use it on a "
                    "model with separate query/key/value projections (BERT layout)"
                )
        layers[layer] = groups
    return layers


def _check_module(plan: Plan, host: Host, layer: int, rule: int | None, mech: nn.Module) -> None:
    """Projection changes a built mechanism declares on its (instance) caps: a K/V shrink
    (``kv_heads``) or re-sized heads (``head_dims``) need scope "module" and a host that can
    take them. Runs before the model is changed (``_build``)."""
    # a built mechanism: caps (possibly set on the instance) and cfg, as in core.Mechanism
    caps = cast(Capabilities, mech.caps)
    name = cast(MechanismConfig, mech.cfg).name
    where = f"{_rule_text(plan, rule)}, layer {layer}"
    adopts = hasattr(mech, "adopt_projections")
    if (adopts or caps.kv_heads is not None) and not host.fused:
        wrapped = [p for p in host.proj
                   if type(getattr(host.attention[layer], p)) is not nn.Linear]
        if wrapped:  # a tuner's wrapper (peft LoRA) would be replaced, or half-converted
            raise SurgeryError(
                f"{where}: {name!r} {'replaces' if adopts else 'shrinks'} the projections, "
                f"but {', '.join(map(repr, wrapped))} is not a plain nn.Linear (wrapped by "
                "a tuner, or already changed); apply the plan to a freshly loaded model "
                "before any tuner")
    if caps.kv_heads is None and caps.head_dims is None:
        return
    if caps.scope != "module":
        raise SurgeryError(
            f"{where}: {name!r} declares kv_heads/head_dims but scope {caps.scope!r}; "
            "changing projections needs scope 'module' (fix the mechanism)")
    if caps.kv_heads is not None and caps.head_dims is not None:
        raise SurgeryError(f"{where}: {name!r} declares both kv_heads and head_dims; surgery "
                           "does one of them per layer (fix the mechanism)")
    if caps.kv_heads is not None and not host.fused:  # fused: no shrink (hf.fused)
        now = _kv_heads_now(host.attention[layer], host)
        if now % caps.kv_heads:
            raise SurgeryError(
                f"{where}: {name!r} asks for {caps.kv_heads} K/V heads, which does "
                f"not divide the layer's {now} K/V heads"
            )
    if caps.head_dims is not None and caps.head_dims != (host.head_dim, host.head_dim):
        try:
            _resize_site(host, host.attention[layer], *caps.head_dims)
        except ValueError as e:
            raise SurgeryError(f"{where}: {name!r} re-sizes the heads to dk, dv = "
                               f"{caps.head_dims}, but {e}") from None


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
            _check_module(plan, host, layer, rule, mech)
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


# ------------------------------------------------------------- re-sized heads (head_size)


def _resize_site(host: Host, attn: nn.Module, dk: int, dv: int) -> tuple[nn.Module, str]:
    """Where a layer's heads are re-sized to dk, dv: (the owner of the output projection, its
    attribute name). Raises ValueError saying why it cannot be done."""
    family = FAMILIES.get(host.family)
    if host.fused or family is None:
        kind = "a fused Q/K/V projection" if host.fused else f"the {host.family} layout"
        known = ", ".join(k for k, f in sorted(FAMILIES.items()) if f.proj[0] != f.proj[1])
        raise ValueError(f"head re-sizing knows the separate query/key/value layouts of "
                         f"{known}, not {kind}; use one of those models")
    h, d = host.num_heads, host.head_dim
    step = d // math.gcd(h, d)  # h*x is a multiple of d iff x is a multiple of step
    if dk % step or dv % step:
        raise ValueError(f"the host splits its projections into heads of {d} features, so "
                         f"h*dk and h*dv (h = {h}) must be multiples of {d}: choose dk and dv "
                         f"as multiples of {step}")
    for name in host.proj:
        lin = getattr(attn, name)
        if type(lin) is not nn.Linear or lin.out_features != h * d:
            raise ValueError(f"its {name!r} projection is not a plain nn.Linear with {h * d} "
                             "outputs (wrapped by a tuner, or already changed); apply the "
                             "plan to a freshly loaded model before any tuner")
    site: tuple[nn.Module, str] | None = None
    if type(getattr(attn, "out_lin", None)) is nn.Linear:  # DistilBERT
        site = (attn, "out_lin")
    for mod in host.base.modules():  # BERT layout: BertAttention.{self, output.dense}
        out = getattr(mod, "output", None)
        if getattr(mod, "self", None) is attn and type(getattr(out, "dense", None)) is nn.Linear:
            site = (cast(nn.Module, out), "dense")
    if site is None or getattr(*site).in_features != h * d:
        raise ValueError(f"the output projection after the heads of {type(attn).__name__} "
                         f"(a plain nn.Linear with {h * d} inputs) was not found")
    return site


def _resize_rows(lin: nn.Linear, heads: int, d_old: int, d_new: int, scale: float = 1.0,
                 random: bool = False) -> nn.Linear:
    """Projection with ``heads`` heads of ``d_new`` outputs: per head the first
    min(d_old, d_new) rows of ``lin`` times ``scale``, then new rows: zeros, or with
    ``random`` N(0, std of lin.weight) from the global RNG (new biases 0)."""
    keep, n_in = min(d_old, d_new), lin.in_features
    new = nn.Linear(n_in, heads * d_new, bias=lin.bias is not None, device=lin.weight.device,
                    dtype=lin.weight.dtype)
    with torch.no_grad():
        w = torch.zeros_like(new.weight).view(heads, d_new, n_in)
        if random and d_new > keep:
            std = lin.weight.float().std()
            w[:, keep:] = (torch.randn(heads, d_new - keep, n_in, device=w.device) * std).to(w)
        w[:, :keep] = lin.weight.view(heads, d_old, n_in)[:, :keep] * scale
        new.weight.copy_(w.view(-1, n_in))
        if lin.bias is not None:
            bias = torch.zeros_like(new.bias).view(heads, d_new)
            bias[:, :keep] = lin.bias.view(heads, d_old)[:, :keep] * scale
            new.bias.copy_(bias.view(-1))
    for p, old in ((new.weight, lin.weight), (new.bias, lin.bias)):
        if p is not None and old is not None:
            p.requires_grad_(old.requires_grad)
    return new


def _resize_cols(lin: nn.Linear, heads: int, d_old: int, d_new: int) -> nn.Linear:
    """Output projection reading ``heads`` heads of ``d_new`` inputs: per head the first
    min(d_old, d_new) input columns of ``lin``, new columns 0; the bias is kept."""
    keep, n_out = min(d_old, d_new), lin.out_features
    new = nn.Linear(heads * d_new, n_out, bias=lin.bias is not None, device=lin.weight.device,
                    dtype=lin.weight.dtype)
    with torch.no_grad():
        w = torch.zeros_like(new.weight).view(n_out, heads, d_new)
        w[:, :, :keep] = lin.weight.view(n_out, heads, d_old)[:, :, :keep]
        new.weight.copy_(w.view(n_out, -1))
        if lin.bias is not None:
            new.bias.copy_(lin.bias)
    for p, old in ((new.weight, lin.weight), (new.bias, lin.bias)):
        if p is not None and old is not None:
            p.requires_grad_(old.requires_grad)
    return new


def _resize_heads(attn: nn.Module, host: Host, dk: int, dv: int) -> int:
    """Re-size one layer's heads to dk (Q, K) and dv (V, output projection input); returns
    the change in parameter count. Conversion: see ``head_size`` (mechanisms.heads_structure):
    for dk, dv >= d the layer computes exactly what it did (W_q rows scaled so that the
    scores under the new 1/sqrt(dk) equal the old ones; zero new Q rows and W_o columns).
    The host keeps splitting projections into heads of d features (h*dk/d "heads" of q and
    k, h*dv/d of v); ``AttnlabLayer`` regroups them into h heads of dk and dv. The module's
    ``scaling`` becomes 1/sqrt(dk)."""
    h, d = host.num_heads, host.head_dim
    owner, out_name = _resize_site(host, attn, dk, dv)
    q_name, k_name, v_name = host.proj
    old_scale = getattr(attn, "scaling", d**-0.5)  # the host's score scale (1/sqrt(d))
    new = {
        q_name: _resize_rows(getattr(attn, q_name), h, d, dk, scale=old_scale * dk**0.5),
        k_name: _resize_rows(getattr(attn, k_name), h, d, dk, random=True),
        v_name: _resize_rows(getattr(attn, v_name), h, d, dv, random=True),
    }
    out = _resize_cols(getattr(owner, out_name), h, d, dv)
    count = sum(p.numel() for lin in (*new.values(), out) for p in lin.parameters())
    count -= sum(p.numel() for name in new for p in getattr(attn, name).parameters())
    count -= sum(p.numel() for p in getattr(owner, out_name).parameters())
    for name, lin in new.items():
        setattr(attn, name, lin)
    setattr(owner, out_name, out)
    if hasattr(attn, "scaling"):
        attn.scaling = dk**-0.5
    return count


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


def apply_plan(model: nn.Module, plan: Any, *, max_len: int | None = None,
               convert_projections: bool = True) -> SurgeryReport:
    """Install ``plan`` (anything :meth:`Plan.parse` takes) into ``model``; see module doc.

    max_len: ``HeadDims.max_len`` for the mechanisms (default: the model's
    ``max_position_embeddings``); set it lower to size length-bound mechanisms such as
    Linformer for the sequence length you train with. Re-applying a plan replaces the
    previous mechanisms, except after a K/V shrink (which cannot be undone).
    convert_projections: let mechanisms that replace the query/key projections
    (``adopt_projections``) convert the pretrained ones; ``load_pretrained`` passes False,
    since the saved weights replace them anyway.
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
        if isinstance(old, AttnlabLayer) and old.head_dims is not None:
            raise SurgeryError(
                f"layer {layer}'s heads were re-sized to dk, dv = {old.head_dims} by "
                f"{', '.join(old.names())!r}, which cannot be undone; apply the new plan to a "
                "freshly loaded model instead"
            )
        if isinstance(old, AttnlabLayer) and old.kv_heads is not None:
            names = ", ".join(old.names())
            raise SurgeryError(
                f"layer {layer}'s K/V projections were shrunk to {old.kv_heads} heads by "
                f"{names!r}, which cannot be undone; apply the new plan to a freshly loaded "
                "model instead"
            )
        if isinstance(old, AttnlabLayer) and any(
                hasattr(m, "adopt_projections") for m in old.mechanisms):
            raise SurgeryError(
                f"layer {layer}'s query/key projections were replaced by "
                f"{', '.join(old.names())!r}, which cannot be undone; apply the new plan to a "
                "freshly loaded model instead"
            )
    layers = _validate(plan, host, max_len)
    built = _build(plan, host, layers, max_len)

    # -- nothing has changed so far; from here on the model is modified --------------------
    switch_to_attnlab(model, host)
    holder = ForwardState()
    params_added = params_removed = 0
    counted: set[int] = set()
    kv_by_layer: dict[int, int] = {}
    dims_by_layer: dict[int, tuple[int, int]] = {}
    for layer, attn in enumerate(host.attention):
        groups = built[layer]
        kv = hd = None
        if len(groups) == 1 and not host.fused:  # a fused Q/K/V projection is never shrunk
            kv = getattr(groups[0][1].caps, "kv_heads", None)
            hd = getattr(groups[0][1].caps, "head_dims", None)
        if hd is not None and hd != (host.head_dim, host.head_dim):
            delta = _resize_heads(attn, host, *hd)
            params_added += max(delta, 0)
            params_removed += max(-delta, 0)
            dims_by_layer[layer] = hd
        else:
            hd = None
        if kv is not None and kv == _kv_heads_now(attn, host):
            kv = None  # nothing to shrink (gqa with g = the layer's K/V heads)
        if kv is not None:
            now = _kv_heads_now(attn, host)
            for name in host.proj[1:]:
                lin = getattr(attn, name)
                setattr(attn, name, _shrink_linear(lin, now, kv, host.head_dim))
                params_removed += sum(p.numel() for p in lin.parameters()) - sum(
                    p.numel() for p in getattr(attn, name).parameters())
            kv_by_layer[layer] = kv
        adopt = getattr(groups[0][1], "adopt_projections", None) if len(groups) == 1 else None
        if adopt is not None and not host.fused:  # e.g. collaborative: shared W_Q, W_K
            old_qk = [getattr(attn, name) for name in host.proj[:2]]
            new_qk = adopt(*old_qk, convert=convert_projections)  # converts the Q/K weights
            for name, lin in zip(host.proj[:2], new_qk, strict=True):
                setattr(attn, name, lin)
            params_removed += sum(p.numel() for lin in old_qk for p in lin.parameters())
            params_added += sum(p.numel() for lin in new_qk for p in lin.parameters())
        new = AttnlabLayer(layer, host.num_heads, groups, holder, kv_heads=kv, head_dims=hd)
        new.train(attn.training)  # the host's mode: a model in eval stays in eval
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
        head_dims=dims_by_layer,
        plan=plan,
        unread=unread_layers(built, host.fused),
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
