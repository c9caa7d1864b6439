"""The jump strength of Jump Self-attention and its inputs: the one place every exact
link decision of ``_jat_adjacency`` and ``_jat_pairs`` is evaluated.

U_k[i, j] = ((S[i, k] * S[j, k]) / len_k) / d with len_k = max(||K_k||_2, 1), the official
expression and evaluation order (github zhouhaoyi/JAT2022, ``get_attn_adj``).
Shape glossary: n = length (queries = keys), d = head dim.
"""

from __future__ import annotations

import torch


def key_length(k: torch.Tensor) -> torch.Tensor:
    """len_k = max(||K_k||_2, 1) per key, from k [..., n, d] -> [..., n] (detached)."""
    return torch.clamp_min(torch.linalg.vector_norm(k.detach(), dim=-1), 1.0)


def jump_strength(
    a: torch.Tensor, b: torch.Tensor, key_len: torch.Tensor, head_dim: int, sign: bool
) -> torch.Tensor:
    """U = ((a * b) / len_k) / d, the official expression and evaluation order.

    ``sign``: zero where both a and b are negative (the official ``jat_sgn``). Every
    threshold decision in this module goes through this function, so the fast path and
    the naive path round identically.
    """
    u = a * b / key_len / head_dim
    if sign:
        u = torch.where((a < 0) & (b < 0), torch.zeros((), dtype=u.dtype), u)
    return u


def _clean(scores: torch.Tensor) -> torch.Tensor:
    """Detached scores with NaN -> 0 (infinities kept); one pass."""
    s = scores.detach()
    return torch.nan_to_num(s, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
