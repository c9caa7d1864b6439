"""Dense masked softmax attention through ``F.scaled_dot_product_attention``, when no
weights are returned: the short-input path of the position patterns (``_patternrun.run_pattern``),
``hardcoded_gaussian`` (its prior as the bias, zero queries and keys), ``mca`` (the
compressed slots' mask as the bias), and per group of keys: ``clustered`` (the centroid
queries), ``routing`` (clusters as heads) and ``poolingformer``'s slots (query blocks as
the batch).

Why: below the blocked engine's length (and for BigBird when its blocks cover about every
key) a pattern is dense softmax under its mask. ``core.reference_attention`` builds that
as [b, h, n, m] scores, a masked softmax and a product, each a pass that autograd keeps;
SDPA with the mask as ``attn_mask`` runs torch's fused kernel (on the CPU the flash kernel,
which takes the mask and never keeps the n x m probabilities). Same semantics as the
reference: the pattern's additive bias, the key mask and ``causal`` (j <= i) as -inf, and
a row with no allowed key gives 0. torch 2.13's CPU kernels already return 0 for a row of
-inf; for kernels that give NaN there, such a row is given an all-zero mask row (every
key, finite) and its output is zeroed afterwards, so no NaN reaches the output or the
gradients on any of them. Attention dropout is SDPA's (on the probabilities, as the reference's).

``sdpa`` is the one call of ``F.scaled_dot_product_attention`` for the mechanisms (this
module's and ``dense.Softmax``'s): torch's CPU fused kernel needs one head dim for q, k and
v, and without it SDPA falls back to its math path, which keeps the [b, h, n, m]
probabilities for the backward (``collaborative``: shared width Dk = h*d against the value's
d; ``lowrank_band``: rank r against d). Zero columns make the dims equal, exactly.
Shapes: b batch, h heads, n queries, m keys, d / dv head dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core import causal_mask


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
         attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
         is_causal: bool = False, scale: float) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` -> [b, h, n, dv], with q, k [b, h, n|m, d] and
    v [b, h, m, dv] brought to one head dim where that lets the CPU fused kernel run: on the
    CPU, without dropout (the kernel has none there) and with a mask that needs no gradient,
    the narrower side gets zero columns (q and k together: each score gains 0 * 0 terms; v:
    output columns of 0, cut off). ``scale`` is required: SDPA's default would follow the
    padded width. Elsewhere (CUDA's memory-efficient kernel takes d != dv) the call is
    unchanged."""
    d, dv = q.shape[-1], v.shape[-1]
    if (d != dv and dropout_p == 0 and q.device.type == "cpu"
            and (attn_mask is None or not attn_mask.requires_grad)):
        if d < dv:
            q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
        else:
            v = F.pad(v, (0, d - dv))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                             scale=scale)
        return out[..., :dv]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale)


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                key_mask: torch.Tensor | None, causal: bool, scale: float,
                dropout: float) -> torch.Tensor:
    """softmax(Q K^T * scale + bias + masks) V -> [b, h, n, dv]; q [b, h, n, d], k, v
    [b, h, m, d|dv], bias [1, n, m] (one for every head) or [b|1, h|1, n, m] (additive: a
    pattern's 0 / -inf, or any constant prior), key_mask [b, m] (True = key) or None,
    causal: j <= i (queries aligned to the last n keys). Rows with no allowed key -> 0."""
    n, m = q.shape[-2], k.shape[-2]
    neg = float("-inf")
    mask = bias.to(device=q.device, dtype=q.dtype)
    mask = mask if mask.dim() == 4 else mask[:, None]  # [b|1,h|1,n,m]
    if key_mask is not None:
        keys = key_mask.to(device=q.device, dtype=torch.bool)[:, None, None, :]  # [b,1,1,m]
        mask = mask.masked_fill(~keys, neg)  # [b,1,n,m]
    if causal:
        mask = mask.masked_fill(~causal_mask(n, m, q.device), neg)
    live = ~torch.isneginf(mask).all(-1, keepdim=True)  # [b|1,h|1,n,1]
    # compiled: no data-dependent branch (a graph break in every call); the same values
    dead = torch.compiler.is_compiling() or not bool(live.all())
    if dead:  # a row of -inf would give NaN: give it every key, zero it after
        mask = mask.masked_fill(~live, 0.0)
    out = sdpa(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)  # [b,h,n,dv]
    return out * live.to(out.dtype) if dead else out
