"""Projections no head reads, and the tuner's parameters that would never train there.

A mechanism that reads neither q nor k (``caps.reads()``: ``mega``, ``average``,
``hardcoded_gaussian``, the random Synthesizer) or reads no k (the pure dense Synthesizer,
Reformer's shared Q/K in ``lsh``) on every head of a layer leaves that layer's Q (or K)
projection out of the loss: its weights, and LoRA or BitFit parameters a tuner puts on it,
get no gradient and keep their initial values while counting as trainable.
:func:`unread_projections` lists such projections after surgery; :func:`untrained_warning`
names the trainable parameters among them once the tuner is applied. The runner warns with
it for the tuners that adapt the modules a user names (LoRA's ``target_modules``), where
the targets are a choice; the tuners that train every weight or every bias (full, BitFit,
Diff-Prune, ``wo_sparse``, ``mae``) leave those few parameters unchanged as the plan's
documented effect, with nothing to choose.
A fused Q/K/V projection is read as long as v is, so it is never listed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from .arch import inspect_model
from .backend import LAYER_ATTR, AttnlabLayer

ROLES = ("query", "key")  # the projections a plan can leave unread, Q then K


def unread_layers(built: dict[int, Any], fused: bool) -> dict[int, tuple[str, ...]]:
    """layer -> the projections (``ROLES``) no head of it reads, for the mechanisms surgery
    built for a plan (``built``: layer -> [(heads, mechanism)]; ``caps.reads()``); none for
    a fused Q/K/V projection, which v reads. ``SurgeryReport.unread``."""
    if fused:
        return {}
    found = {layer: _unread(mech for _, mech in groups) for layer, groups in built.items()}
    return {layer: roles for layer, roles in found.items() if roles}


def _unread(mechanisms: Iterable[Any]) -> tuple[str, ...]:
    reads = [mech.caps.reads() for mech in mechanisms]
    return tuple(role for i, role in enumerate(ROLES) if not any(r[i] for r in reads))


@dataclass(frozen=True)
class Unread:
    """One projection no head of its layer reads."""

    path: str  # module path in the model, e.g. "bert.encoder.layer.2.attention.self.key"
    layer: int
    role: str  # "query" or "key"
    mechanisms: tuple[str, ...]  # the layer's mechanism names


def unread_projections(model: nn.Module, unread: Mapping[int, tuple[str, ...]]
                       ) -> list[Unread]:
    """The Q and K projections of ``model`` that no head of their layer reads, given the
    ``SurgeryReport.unread`` of the plan applied to it (layer -> roles)."""
    if not unread:
        return []
    host = inspect_model(model)
    paths = {id(m): name for name, m in model.named_modules()}
    found = []
    for layer, roles in sorted(unread.items()):
        attn = host.attention[layer]
        installed = getattr(attn, LAYER_ATTR)
        assert isinstance(installed, AttnlabLayer)
        for role in roles:
            proj = getattr(attn, host.proj[ROLES.index(role)])
            found.append(Unread(paths[id(proj)], layer, role, tuple(installed.names())))
    return found


def fix(modules: str) -> str:
    """The fix both warnings name (``untrained_warning`` and ``validate``'s)."""
    return (f"leave {modules} out of target_modules, or keep a mechanism that reads them on "
            "some head of those layers")


def _under(param: str, path: str) -> bool:
    """Whether parameter name ``param`` lies under module ``path``, also once a wrapper
    (PEFT's ``base_model.model.``) prefixes the names and LoRA nests the projection."""
    return f".{path}." in f".{param}"


def untrained_warning(model: nn.Module, unread: list[Unread]) -> str | None:
    """One line naming the trainable parameters of ``model`` (the tuned model, names possibly
    prefixed by a wrapper) under the ``unread`` projections, or None when there are none."""
    hit = {u: [name for name, p in model.named_parameters()
               if p.requires_grad and _under(name, u.path)] for u in unread}
    hit = {u: names for u, names in hit.items() if names}
    if not hit:
        return None
    count = sum(len(names) for names in hit.values())
    # the projections' own module names (query, q_lin, q_proj, ...), Q before K
    modules = "/".join(dict.fromkeys(u.path.rsplit(".", 1)[-1]
                                     for u in sorted(hit, key=lambda u: ROLES.index(u.role))))
    layers = ", ".join(str(x) for x in sorted({u.layer for u in hit}))
    mechs = ", ".join(sorted({m for u in hit for m in u.mechanisms}))
    example = next(iter(hit.values()))[0]
    return (f"{count} trainable parameter(s) in the {modules} projections of layer(s) "
            f"{layers} get no gradient from the task loss (e.g. {example}): no head of those "
            f"layers reads them ({mechs}); {fix(modules)}")
