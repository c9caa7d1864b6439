"""Query rows in chunks, each under an activation checkpoint: training memory O(chunk * m)
for mechanisms that build their scores explicitly ([b, h, n, m]: a learned or
query-dependent term on every score) and whose query rows are independent given k, v and
the parameters: ``gaussian_prior``, ``gaussian_transformer``, ``talking_heads`` (its head
mixes act per (query, key) pair), ``synthesizer``, ``camtl_prior``, ``disagreement`` and
``pattern_loss`` (each chunk also returns its share of the loss), and ``realformer`` (its
chunks also return their rows of the scores the next layer adds). Also the one home of
what those mechanisms share: ``allowed_pairs`` (the visibility mask of explicit scores:
padding, causality) and ``attend_rows`` (masked softmax, attention dropout, @ v).

Why: the dense form keeps, for the backward, the scores, the biased scores, the softmax
probabilities and a dropout mask, each [b, h, n, m]: at 4 x 4096 tokens and 2 heads that is
0.5 GB apiece per layer, where a flash softmax keeps O(n). Here the rows run in chunks of
about ``CHUNK_ELEMS`` scores. With gradients on, each chunk runs under a non-reentrant
checkpoint: autograd keeps the chunk's inputs (a view of q; k, v and the parameters are
shared by every chunk) and recomputes one chunk's scores at a time in the backward. The
arithmetic of each row is the dense form's, so the result is the same; a chunk's dropout
mask is redrawn identically in the recomputation (the checkpoint restores the RNG state
when attention dropout is on). Without gradients the chunks only bound the forward's
transient memory.

Shapes: b batch, h heads, n query rows, m keys, c rows of a chunk, dv value head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..core import AttnContext, causal_mask, masked_softmax

# Scores per chunk (b * h * c * m): 2 Mi floats, 8 MB in float32 per buffer.
CHUNK_ELEMS = 1 << 21


def allowed_pairs(ctx: AttnContext, shape: torch.Size | tuple[int, ...],
                  device: torch.device, first_row: int = 0,
                  num_queries: int | None = None) -> torch.Tensor:
    """[b,h,n,m] bool (an expanded view): key j is visible to query i (padding, causality).
    For a chunk of query rows: the n rows are rows first_row .. of ``num_queries`` (the
    causal alignment is to the last num_queries keys, as ``core.causal_mask``'s)."""
    n, m = shape[-2], shape[-1]
    if ctx.causal:  # query row r sees keys j <= r + (m - total)
        total = n if num_queries is None else num_queries
        if first_row == 0 and total == n:
            allowed = causal_mask(n, m, device)  # [n,m]
        else:
            i = torch.arange(first_row, first_row + n, device=device)[:, None] + (m - total)
            allowed = torch.arange(m, device=device)[None, :] <= i  # [n,m]
    else:
        allowed = torch.ones(n, m, dtype=torch.bool, device=device)  # [n,m]
    allowed = allowed.expand(shape)  # [b,h,n,m]
    if ctx.key_mask is not None:
        allowed = allowed & ctx.key_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
    return allowed


def attend_rows(scores: torch.Tensor, v: torch.Tensor, ctx: AttnContext, training: bool,
                first_row: int = 0, num_queries: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scores) over the visible keys, attention dropout in training, @ v:
    (out [b,h,c,dv], probabilities [b,h,c,m] before dropout). scores [b|1,h,c,m]
    (broadcast over the batch), v [b,h,m,dv]; the c rows are rows first_row .. of
    ``num_queries`` (all of them by default)."""
    shape = (v.shape[0], *scores.shape[1:])
    allowed = allowed_pairs(ctx, shape, v.device, first_row, num_queries)
    probs = masked_softmax(scores.expand(shape), allowed)  # [b,h,c,m]
    p = F.dropout(probs, ctx.dropout, training=True) if draws_dropout(ctx, training) else probs
    return p @ v.to(p.dtype), probs  # [b,h,c,dv]


def draws_dropout(ctx: AttnContext, training: bool) -> bool:
    """Whether attention dropout draws random numbers in this call."""
    return bool(training and ctx.dropout > 0)


def rows_per_chunk(b: int, h: int, m: int) -> int:
    """c: the query rows of one chunk of about CHUNK_ELEMS scores (at least 1)."""
    return max(1, CHUNK_ELEMS // max(1, b * h * m))


def in_row_chunks(rows: Callable[..., Any], q: torch.Tensor, m: int, *, dropout: bool,
                  row_inputs: Sequence[torch.Tensor | None] = (),
                  chunk_inputs: Sequence[Sequence[torch.Tensor | None]] = (),
                  concat_extras: bool = False) -> Any:
    """The output [b, h, n, dv] of ``rows(r0, q_rows, *row_inputs_rows)`` -> [b, h, c, dv],
    the attention of query rows r0 .. r0 + c - 1 (q_rows = q[:, :, r0:r0 + c], q
    [b, h, n, d]) over the m keys, run chunk by chunk (under checkpoints when gradients are
    on). ``row_inputs``: further [b, h, n, ...] tensors cut into the same rows (None stays
    None). The cuts are one ``split`` per tensor, whose backward writes each gradient
    once (slicing per chunk would add a full-size zero gradient per chunk).
    ``chunk_inputs``: when given, one sequence of further arguments per chunk (chunks of
    ``rows_per_chunk(b, h, m)`` rows from row 0), appended after the row inputs' rows:
    inputs a chunk needs that are not its rows, e.g. the neighbouring rows a convolution
    reads.
    ``rows`` may also return a tuple (out, *extras): then the result is (out, *extras),
    each extra summed over the chunks (a per-row quantity reduced over the rows, e.g. a
    loss term), or with ``concat_extras`` concatenated along dim 2 like the output
    (per-row tensors such as realformer's scores). ``dropout``: the rows draw random
    numbers (attention dropout in training), so the checkpoints keep the RNG state for
    the recomputation."""
    b, h, n = q.shape[0], q.shape[1], q.shape[2]
    c = rows_per_chunk(b, h, m)
    starts = range(0, n, c)
    if chunk_inputs and len(chunk_inputs) != len(starts):
        raise ValueError(f"in_row_chunks got chunk_inputs for {len(chunk_inputs)} chunks, "
                         f"but {n} rows make {len(starts)} chunks of {c}")
    if c >= n:
        return rows(0, q, *row_inputs, *(chunk_inputs[0] if chunk_inputs else ()))
    grad = torch.is_grad_enabled()
    cuts = [q.split(c, dim=2)] + [(None,) * len(starts) if x is None
                                  else x.split(c, dim=2) for x in row_inputs]
    parts = []
    for i, r0 in enumerate(starts):
        args = [cut[i] for cut in cuts]  # q_rows [b,h,c,d], then the row inputs' rows
        args += chunk_inputs[i] if chunk_inputs else ()
        if grad:
            parts.append(checkpoint(rows, r0, *args, use_reentrant=False,
                                    preserve_rng_state=dropout))
        else:
            parts.append(rows(r0, *args))
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts, dim=2)  # [b,h,n,dv]
    out = torch.cat([p[0] for p in parts], dim=2)  # [b,h,n,dv]
    if concat_extras:
        extras = [torch.cat([p[i] for p in parts], dim=2) for i in range(1, len(parts[0]))]
    else:
        extras = [torch.stack([p[i] for p in parts]).sum(0) for i in range(1, len(parts[0]))]
    return (out, *extras)
