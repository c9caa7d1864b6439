"""Capture attention probabilities, computed by the attnlab backend itself.

``capture_attention(model, batch)`` runs one forward with the "attnlab" attention function
recording every layer's probabilities, and returns an :class:`AttentionCache`
(``cache[layer] -> [b, h, n, m]`` float32 on CPU, plus the batch's ``input_ids`` and
``attention_mask``). Because the probabilities come from the same function that computes
the outputs, what is captured is what the model used: plain softmax heads, and every
mechanism that can materialise probabilities (sparse patterns, priors, JAT, ...).

A model that is not on "attnlab" is switched to it for the capture (all heads plain
softmax, the same function as "sdpa"/"eager") and switched back afterwards. Capture runs in
eval mode under ``torch.no_grad()``; the training flag is restored.

Padding: a padded key gets probability 0 in every row (except under a mechanism that
declares ``key_mask_ok=False``, which warns that it does not mask padding); the row of a
padded query is computed like any other (over the real keys) and means nothing, so crop
each example to its real tokens with ``attention_mask`` (as ``attnlab.analysis.token_infos``
does) before using the maps.

Mechanisms that never form an n x m probability matrix (linearised, low-rank, ...) cannot be
captured: by default that is an error naming the layer and mechanism; with
``on_missing="none"`` such layers map to ``None`` instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn

from .arch import inspect_model
from .backend import BACKEND, recording, register_backend

_NOT_INPUTS = {"labels", "start_positions", "end_positions", "next_sentence_label"}


class AttentionCache(Mapping[int, torch.Tensor | None]):
    """layer -> probabilities [b, h, n, m] (float32, CPU), in layer order (0-based).

    Attributes: ``input_ids`` [b, n] and ``attention_mask`` [b, n] of the captured batch
    (CPU, or None when the batch had none) and ``mechanisms`` (layer -> mechanism names).
    """

    def __init__(
        self,
        probs: dict[int, torch.Tensor | None],
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        mechanisms: dict[int, list[str]],
    ) -> None:
        self._probs = dict(sorted(probs.items()))
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.mechanisms = mechanisms

    def __getitem__(self, layer: int) -> torch.Tensor | None:
        try:
            return self._probs[layer]
        except KeyError:
            raise KeyError(
                f"no layer {layer} in this cache; layers are 0-{len(self._probs) - 1}"
            ) from None

    def __iter__(self) -> Iterator[int]:
        return iter(self._probs)

    def __len__(self) -> int:
        return len(self._probs)

    def stack(self) -> torch.Tensor:
        """All layers as one tensor [L, b, h, n, m] (error if a layer has no probabilities)."""
        missing = [layer for layer, p in self._probs.items() if p is None]
        if missing:
            raise ValueError(f"layers {missing} have no probabilities; index layers one by one")
        return torch.stack([p for p in self._probs.values() if p is not None])

    def __repr__(self) -> str:
        shapes = {layer: (None if p is None else tuple(p.shape)) for layer, p in self.items()}
        return f"AttentionCache({shapes})"


def _model_inputs(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``batch`` that ``model.forward`` takes by name (labels dropped)."""
    params = inspect.signature(model.forward).parameters
    named = {k for k, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    device = next(model.parameters()).device
    out = {}
    for key, val in batch.items():
        if key in named and key not in _NOT_INPUTS:
            out[key] = val.to(device) if isinstance(val, torch.Tensor) else val
    if not out:
        raise ValueError(
            f"batch has none of {type(model).__name__}.forward's inputs (got keys "
            f"{sorted(batch)}); pass e.g. tokenizer(texts, padding=True, return_tensors='pt')"
        )
    return out


def capture_attention(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    on_missing: Literal["error", "none"] = "error",
) -> AttentionCache:
    """One forward of ``model`` on ``batch``, recording every layer's probabilities."""
    if on_missing not in ("error", "none"):
        raise ValueError(f"on_missing must be 'error' or 'none', got {on_missing!r}")
    # torch.compile's wrapper: record on the original module, eagerly (the recorder is not
    # read inside a compiled graph)
    model = getattr(model, "_orig_mod", model)
    host = inspect_model(model)
    inputs = _model_inputs(model, batch)
    register_backend()
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None) or "sdpa"
    was_training = model.training
    switched = previous != BACKEND
    try:
        if switched:
            model.set_attn_implementation(BACKEND)  # type: ignore[operator]  # HF method
        model.eval()
        with torch.no_grad(), recording() as rec:
            model(**inputs)
    finally:
        if switched:
            model.set_attn_implementation(previous)  # type: ignore[operator]  # HF method
        model.train(was_training)

    probs: dict[int, torch.Tensor | None] = {}
    names: dict[int, list[str]] = {}
    for layer, attn in enumerate(host.attention):
        installed = getattr(attn, "attnlab", None)
        names[layer] = installed.names() if installed is not None else ["softmax"]
        key = id(attn)
        if key in rec.probs:
            probs[layer] = rec.probs[key]
        elif key in rec.missing:
            if on_missing == "error":
                raise ValueError(
                    f"layer {layer}: mechanism(s) {rec.missing[key]} do not materialise "
                    "attention probabilities, so the layer cannot be captured; pass "
                    "on_missing='none' to capture the other layers"
                )
            probs[layer] = None
        else:
            raise RuntimeError(
                f"layer {layer} ({type(attn).__name__}) did not run through the attnlab "
                "attention function during capture"
            )
    ids = batch.get("input_ids")
    mask = batch.get("attention_mask")
    return AttentionCache(
        probs,
        ids.detach().cpu() if isinstance(ids, torch.Tensor) else None,
        mask.detach().cpu() if isinstance(mask, torch.Tensor) else None,
        names,
    )
