"""Head masks: scale each head's output before the output projection (Michel et al., 2019).

Michel, Levy and Neubig, "Are Sixteen Heads Really Better than One?" (NeurIPS 2019) write a
multi-head layer as ``MHAtt(x) = sum_h xi_h Att_h(x)`` with a mask variable xi_h per head:
xi_h = 0 removes head h, xi_h = 1 leaves it, and ``|d loss / d xi_h|`` is its importance.

Where the mask is applied: transformers 4 had a ``head_mask`` argument that multiplied the
attention probabilities of each head (for a softmax head the same as scaling its output);
transformers 5 removed it from BERT and its clones (``modeling_bert.py`` of 5.24 has no
``head_mask``), and a mask on probabilities could never reach mechanisms that form none
(linear attention, ...). So attnlab masks in its own attention function, for every
mechanism: ``attnlab_attention`` multiplies head h's output [b, n, dv] by xi_h before the
heads are concatenated and W_O is applied. This module is the one way to set that mask.

``head_mask(model, mask)`` is a context manager. ``mask`` is [L, h] (one mask for every
example) or [b, L, h] (one per example of the batch: a single backward then gives each
example's gradient, since example i's output depends on ``mask[i]`` only); values need not be
0 or 1, and gradients flow to ``mask``. A model that is not on the "attnlab" attention
function is switched to it inside (heads without a plan run plain softmax, the same function
as "sdpa"/"eager") and switched back afterwards, as :func:`~attnlab.hf.capture_attention`
does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .arch import Host, inspect_model
from .backend import BACKEND, HEAD_MASK_ATTR, register_backend


@contextmanager
def head_mask(model: nn.Module, mask: torch.Tensor) -> Iterator[Host]:
    """Within the block, every forward of ``model`` scales head (l, h)'s output by
    ``mask[..., l, h]``; yields the model's :class:`Host`. See the module doc."""
    host = inspect_model(model)
    shape = (host.num_layers, host.num_heads)
    if mask.dim() not in (2, 3) or tuple(mask.shape[-2:]) != shape:
        raise ValueError(f"head mask of shape {tuple(mask.shape)} for a model of "
                         f"{shape[0]} layers x {shape[1]} heads; give [{shape[0]}, {shape[1]}] "
                         f"or [batch, {shape[0]}, {shape[1]}]")
    device = next(model.parameters()).device
    register_backend()
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None) or "sdpa"
    switched = previous != BACKEND
    try:
        if switched:
            model.set_attn_implementation(BACKEND)  # type: ignore[operator]  # HF method
        for layer, attn in enumerate(host.attention):
            setattr(attn, HEAD_MASK_ATTR, mask[..., layer, :].to(device))  # [h] or [b, h]
        yield host
    finally:
        for attn in host.attention:
            if HEAD_MASK_ATTR in attn.__dict__:
                delattr(attn, HEAD_MASK_ATTR)
        if switched:
            model.set_attn_implementation(previous)  # type: ignore[operator]  # HF method
