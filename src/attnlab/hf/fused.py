"""Fused-QKV encoders (ModernBERT first) and local (sliding-window) attention layers.

ModernBERT (transformers' ``ModernBertModel``; Warner et al., "Smarter, Better, Faster,
Longer: A Modern Bidirectional Encoder", 2024) differs from the BERT layout in three ways
that matter to surgery. Checked against transformers 5.24 (``modeling_modernbert.py``):

1. **One fused projection** ``Wqkv`` [hidden -> 3*h*d] instead of query/key/value. attnlab
   never rewrites it: ``ModernBertAttention`` splits its output into q, k, v [b,h,n,d]
   before it calls the attention interface, and that call is what attnlab takes over.
   ``arch`` finds such modules by the fused projection's name (:data:`FUSED_NAMES`).
   Module-scope mechanisms that shrink the K/V projections (``mqa``, ``caps.kv_heads``)
   cannot shrink a fused projection: on a fused host surgery leaves it whole, and the
   mechanism receives all h K/V heads, which ``mqa`` mean-pools at run time. That is the
   same function as the shrunk projection right after conversion (the projection is
   linear), without the parameter saving (``SurgeryReport.params_removed`` 0, no
   ``kv_heads`` entry).
2. **Rotary position embeddings.** ``ModernBertAttention.forward`` applies RoPE to q and k
   (``apply_rotary_pos_emb``) *before* it calls the interface, so every mechanism receives
   rotated q, k (exactly what the model's own softmax sees) and plain v. Nothing to redo
   here; ``tests/hf/test_modernbert.py`` checks the parity.
3. **Alternating local / global layers.** Layer l is global when
   ``l % global_attn_every_n_layers == 0``, else local: query i sees keys with
   ``|i - j| <= local_attention // 2`` (``config.sliding_window``). transformers builds a
   separate mask for the local layers (``create_bidirectional_sliding_window_mask``; with the
   "attnlab" mask function, ``sdpa_mask``, a bool [b,1,n,m]: window AND padding), passes it
   as ``attention_mask``, and also passes ``sliding_window=config.sliding_window + 1``
   (flash-attention's inclusive convention) as a keyword. The mask is ``None`` only when
   nothing is padded and n <= the window, i.e. when the window cuts nothing. The
   ``sliding_window`` keyword marks a local layer, and its 4-D mask is then kept whole
   (:func:`local_pattern`, put in ``AttnContext.extras[LOCAL_PATTERN]``) instead of being
   reduced to a key mask [b,m] (which would drop the window).

What a head of a local layer sees (docs/decisions.md #21):

* a mechanism that is softmax over a pattern (``caps.exact`` with ``bias(n, m)``: softmax,
  band, dilated, block_local, bigbird, ...) runs as softmax over its own pattern AND the
  layer's window (and padding, and causality if any): ``softmax`` there is exactly
  ModernBERT's local attention, ``band(window=2)`` is the band cut to the window. It runs as
  dense masked softmax (O(n*m)), not on the mechanism's own fast path
  (:func:`windowed_attention`).
* every other mechanism (linear, low-rank, prototype, jump, multi-query, the layer-scope
  mixers) has no score pattern to cut, so it runs exactly as on a global layer, over every
  unpadded key: the window does not apply to it. A warning says so, once per mechanism.

Global layers are untouched by all of this. This module imports no transformers.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from ..core import AttnContext, AttnOutput, Mechanism, causal_mask, reference_attention

# Attribute names of fused Q/K/V projections (ModernBERT: Wqkv; Phi-3 style: qkv_proj).
FUSED_NAMES = ("Wqkv", "qkv_proj")
LOCAL_PATTERN = "attnlab.local_pattern"  # AttnContext.extras key: [b,1|h,n,m] bool or absent


def layer_windows(attention: Sequence[nn.Module], config: Any) -> tuple[int | None, ...]:
    """One-sided window w (query i sees |i - j| <= w) of every attention module, None for
    global layers. A module is local when it carries a ``sliding_window`` (ModernBERT sets
    it on local layers only); w is ``config.sliding_window``."""
    w = getattr(config, "sliding_window", None)
    return tuple(
        int(w) if w is not None and getattr(m, "sliding_window", None) is not None else None
        for m in attention
    )


# An additive float mask drops a pair whose value is at or below this. transformers' own
# masks use the dtype's minimum or -inf; BERT-style models that build their own (MarkupLM)
# and hand-made 4-D masks use (1 - mask) * -10000. exp(-1000) is 0 in every float dtype, so
# softmax gives such a pair no weight either way.
ADDITIVE_MASKED = -1e3


def mask_allows(mask: torch.Tensor) -> torch.Tensor:
    """transformers' mask -> bool, True = may attend: a bool mask as is, an additive float
    mask (0 = attend, at most :data:`ADDITIVE_MASKED` = not), a 0/1 integer mask."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        return mask > ADDITIVE_MASKED
    return mask != 0


def local_pattern(mask: torch.Tensor | None, sliding_window: int | None,
                  m: int) -> torch.Tensor | None:
    """The allowed (query, key) pairs [b,1|h,n,m] bool of a local layer, else None.

    mask: the ``attention_mask`` the host passed; sliding_window: its ``sliding_window``
    keyword (None on global layers); m: the number of keys the mechanisms will see. Keys
    beyond the mask's (a prefix prepended by prefix tuning) are visible to every query.
    """
    if sliding_window is None or mask is None or mask.dim() != 4:
        return None
    allowed = mask_allows(mask)[..., -m:]  # [b,1|h,n,m0]
    extra = m - allowed.shape[-1]
    if extra > 0:
        allowed = F.pad(allowed, (extra, 0), value=True)  # [b,1|h,n,m]
    return allowed


class PatternMechanism(Mechanism, Protocol):
    """A mechanism module with ``bias(n, m)`` (or ``bias(n, m, layer_idx=...)``)."""

    training: bool
    bias: Callable[..., torch.Tensor]


def windowable(mech: Mechanism) -> TypeGuard[PatternMechanism]:
    """Softmax over a pattern: ``caps.exact`` and a ``bias(n, m)`` to intersect."""
    return bool(mech.caps.exact) and callable(getattr(mech, "bias", None))


@functools.cache
def _bias_takes_layer(cls: type[PatternMechanism]) -> bool:
    return "layer_idx" in inspect.signature(cls.bias).parameters


def _mechanism_bias(mech: PatternMechanism, n: int, m: int, layer_idx: int) -> torch.Tensor:
    if _bias_takes_layer(type(mech)):
        return mech.bias(n, m, layer_idx=layer_idx)
    return mech.bias(n, m)


def windowed_attention(mech: PatternMechanism, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       ctx: AttnContext, pattern: torch.Tensor) -> AttnOutput:
    """Softmax over ``mech.bias`` AND ``pattern`` AND ``ctx.key_mask`` (and ``ctx.causal``).

    q [b,h,n,d], k/v [b,h,m,d], pattern [b,1|h,n,m] bool (True = may attend). Returns out
    [b,h,n,d] and, when ``ctx.need_weights``, probs [b,h,n,m]. A finite part of the bias (an
    additive prior) is kept. Rows with no allowed key give zeros. Without probabilities it
    runs on ``F.scaled_dot_product_attention``; with them on ``core.reference_attention``.
    """
    n, m = q.shape[2], k.shape[2]
    bias = _mechanism_bias(mech, n, m, ctx.layer_idx).to(device=q.device, dtype=q.dtype)
    allowed = pattern & ~torch.isneginf(bias)  # [b,h|1,n,m]
    if ctx.key_mask is not None:
        allowed = allowed & ctx.key_mask[:, None, None, :].to(torch.bool)
    if ctx.causal:
        allowed = allowed & causal_mask(n, m, q.device)
    prior = bias.masked_fill(torch.isneginf(bias), 0.0)  # [h|1,n,m] finite part
    scale = ctx.scale_for(q.shape[-1])
    p = ctx.dropout if mech.training else 0.0
    neg = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)
    if ctx.need_weights:
        out, probs = reference_attention(q, k, v, bias=torch.where(allowed, prior, neg),
                                         scale=scale, dropout=p, training=mech.training)
        return AttnOutput(out, probs)
    row_any = allowed.any(-1, keepdim=True)  # [b,h|1,n,1]
    # rows without keys attend everything (finite, no NaN in either pass), then give zeros
    attn_mask = torch.where(allowed | ~row_any, prior, neg)  # [b,h|1,n,m]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p,
                                         scale=scale)  # [b,h,n,d]
    return AttnOutput(torch.where(row_any, out, torch.zeros((), dtype=out.dtype,
                                                            device=out.device)))


@functools.cache
def _warn_unwindowed(name: str) -> None:
    warnings.warn(
        f"mechanism {name!r} is not softmax over a pattern, so on a local (sliding-window) "
        "layer it attends over every unpadded key: the layer's window does not apply to it "
        "(docs/decisions.md #21). Pattern mechanisms (band, dilated, ...) and softmax "
        "keep the window.",
        stacklevel=4,
    )


def run_mechanism(mech: Mechanism, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  ctx: AttnContext) -> AttnOutput:
    """``mech(q, k, v, ctx)``, with a local layer's window applied as the module doc says."""
    pattern = ctx.extras.get(LOCAL_PATTERN)
    if pattern is None:
        return mech(q, k, v, ctx)
    if windowable(mech):
        return windowed_attention(mech, q, k, v, ctx, pattern)
    _warn_unwindowed(mech.cfg.name)
    return mech(q, k, v, ctx)
