"""Mechanisms' own random streams, carried by training checkpoints.

Some mechanisms draw afresh at every training forward from generators of their own, seeded
by (seed, layer) and never by the global RNG: performer's redrawn features (a draw count),
probsparse's key samples, the clustered mechanisms' hashes and k-means starts, JAT's
probsparse variant (a generator per layer). A checkpoint that restored only the global RNG
would restart those streams, and a resumed run would draw what the first part of the run
had drawn already: it would not end where the uninterrupted run ends.

A module with such a stream offers two methods,

    draw_state() -> dict[str, Tensor | int]     where its streams stand (fresh objects)
    load_draw_state(state) -> None              put them back there

and :func:`draw_states` / :func:`load_draw_states` collect and restore them over a model by
module name (``train.checkpoint`` writes them into each checkpoint). Eval draws are seeded
per call and need no state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def generator_states(streams: Mapping[int, torch.Generator]) -> dict[str, torch.Tensor]:
    """The states of per-layer CPU generators, keyed by the layer as a string."""
    return {str(layer): g.get_state() for layer, g in streams.items()}


def generators_from(states: Mapping[str, torch.Tensor]) -> dict[int, torch.Generator]:
    """Per-layer CPU generators at the given states (the inverse of ``generator_states``)."""
    out: dict[int, torch.Generator] = {}
    for layer, state in states.items():
        g = torch.Generator()
        g.set_state(state)
        out[int(layer)] = g
    return out


def draw_states(model: nn.Module) -> dict[str, dict[str, Any]]:
    """``{module name: its draw_state()}`` over every module of ``model`` that has streams."""
    return {name: m.draw_state() for name, m in model.named_modules()
            if callable(getattr(m, "draw_state", None))}


def load_draw_states(model: nn.Module, states: Mapping[str, Mapping[str, Any]]) -> None:
    """Put every module named in ``states`` back where ``draw_states`` found its streams;
    a name the model lacks, or a module without streams, is a ValueError (another model)."""
    modules = dict(model.named_modules())
    for name, state in states.items():
        m = modules.get(name)
        if m is None or not callable(getattr(m, "load_draw_state", None)):
            raise ValueError(f"the checkpoint has random-stream state for module {name!r}, "
                             "which this model lacks or which draws nothing: it was saved "
                             "from another model")
        m.load_draw_state(state)
