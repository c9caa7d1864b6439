"""The oracle: dense softmax attention over any additive bias, key mask and causal flag.

Every exact mechanism's fast path is tested against this function. It is deliberately
simple and materialises the full n x m score matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    training: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense softmax attention.

    q [b,h,n,d], k [b,h,m,d], v [b,h,m,dv]; bias broadcastable to [b,h,n,m] (additive,
    ``-inf`` forbids a pair); key_mask [b,m] bool True = keep; causal forbids j > i (with
    queries aligned to the last n keys when n != m). Rows with no allowed key give zero
    output and zero probabilities, never NaN. Returns (out [b,h,n,dv], probs [b,h,n,m]).
    """
    n, m = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [b,h,n,m]
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    allowed = torch.ones(n, m, dtype=torch.bool, device=q.device)
    if causal:
        allowed = causal_mask(n, m, q.device)
    allowed = allowed.expand(scores.shape)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :].to(torch.bool)
    allowed = allowed & ~torch.isneginf(scores)
    probs = masked_softmax(scores, allowed)
    p = F.dropout(probs, dropout, training=True) if (training and dropout > 0) else probs
    return torch.matmul(p, v.to(p.dtype)), probs


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis restricted to ``allowed``; all-forbidden rows -> zeros.

    No NaN in the output or in the gradient, whatever the mask.
    """
    row_any = allowed.any(dim=-1, keepdim=True)
    s = scores.masked_fill(~allowed, float("-inf")).masked_fill(~row_any, 0.0)
    return torch.softmax(s, dim=-1) * row_any


def causal_mask(n: int, m: int, device: torch.device | None = None) -> torch.Tensor:
    """[n,m] bool, True where key j <= query i (queries aligned to the last n keys)."""
    i = torch.arange(n, device=device)[:, None] + (m - n)
    j = torch.arange(m, device=device)[None, :]
    return j <= i


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute sums over a sequence in: fp32 for 16-bit floats (which lose too
    much in them), else ``dtype`` itself (float64 stays float64)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
