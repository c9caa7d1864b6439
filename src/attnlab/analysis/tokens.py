"""What the head scorers need to know about each example's tokens.

:class:`TokenInfo` holds one example's real-token positions (padding cropped), which tokens
are structural specials ([CLS]/[SEP]/<s>/</s>), which are "." and, for sentence pairs, the
segment of every token; :func:`token_infos` builds them from a tokenized batch. Kept apart
from the scorers (``heads.py``) so that code which only prepares inputs does not need the
scorer registry, and so that each file stays readable.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)
class TokenInfo:
    """What the scorers need about one example, in cropped coordinates 0..n_i-1.

    ``keep`` maps cropped positions to positions in the padded row (right or left padding).
    ``segment`` is None for a single-segment input; an example is a *pair* when its segment
    ids take more than one value.
    """

    keep: Tensor  # [n_i] long: positions of the real tokens in the padded row
    special: Tensor  # [n_i] bool: structural special tokens ([CLS], [SEP], <s>, </s>)
    period: Tensor  # [n_i] bool: "." tokens (the TLM paper counts them as vertical targets)
    segment: Tensor | None = None  # [n_i] long: segment id per token; None = one segment
    tokens: tuple[str, ...] | None = None  # n_i token strings, for plots and the report

    def __post_init__(self) -> None:
        n = self.keep.numel()
        if self.keep.dim() != 1 or self.keep.dtype != torch.long:
            raise ValueError("TokenInfo.keep must be a 1-d long tensor of real-token positions")
        if n == 0:
            raise ValueError("TokenInfo needs at least one real token (attention_mask all 0?)")
        for name in ("special", "period"):
            t = getattr(self, name)
            if t.shape != (n,) or t.dtype != torch.bool:
                raise ValueError(f"TokenInfo.{name} must be a bool tensor of shape [{n}]")
        if self.segment is not None and self.segment.shape != (n,):
            raise ValueError(f"TokenInfo.segment must have shape [{n}] (one id per real token)")
        if self.tokens is not None and len(self.tokens) != n:
            raise ValueError(f"TokenInfo.tokens has {len(self.tokens)} strings for {n} tokens")

    @property
    def length(self) -> int:
        return self.keep.numel()

    @property
    def is_pair(self) -> bool:
        return self.segment is not None and bool((self.segment != self.segment[0]).any())

    @classmethod
    def from_length(
        cls,
        n: int,
        *,
        special: Sequence[int] = (0, -1),
        period: Sequence[int] = (),
        segment: Sequence[int] | Tensor | None = None,
        tokens: Sequence[str] | None = None,
    ) -> TokenInfo:
        """An unpadded example of n tokens; ``special``/``period`` are positions (negatives ok)."""
        sp = torch.zeros(n, dtype=torch.bool)
        sp[list(special)] = True
        pe = torch.zeros(n, dtype=torch.bool)
        pe[list(period)] = True
        seg = None if segment is None else torch.as_tensor(segment, dtype=torch.long)
        toks = None if tokens is None else tuple(tokens)
        return cls(keep=torch.arange(n), special=sp, period=pe, segment=seg, tokens=toks)


def _segments_from_separators(is_sep: Tensor) -> Tensor:
    """Segment id = number of separator runs that ended before the token.

    [CLS] A [SEP] B [SEP] -> 0..0 1..1 (as BERT's token_type_ids); RoBERTa's
    <s> A </s></s> B </s> -> A and both middle </s> in 0, B and the last </s> in 1.
    """
    ends = is_sep & ~torch.cat([is_sep[1:], is_sep.new_zeros(1)])  # [n] last sep of a run
    return torch.cumsum(ends.long(), 0) - ends.long()


def token_infos(
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    token_type_ids: Tensor | None = None,
    tokenizer: Any = None,
    *,
    special_ids: Iterable[int] | None = None,
    period_ids: Iterable[int] | None = None,
    sep_id: int | None = None,
) -> list[TokenInfo]:
    """Build one :class:`TokenInfo` per row of a tokenized batch.

    With a tokenizer, special ids are ``tokenizer.all_special_ids`` minus [UNK] and [MASK]
    (those stand in for ordinary words, so attending to them is not a "vertical" pattern),
    "." tokens are found by their string (``"."``, ``"Ġ."``, ``"▁."``), and token strings are
    kept. Without a tokenizer pass ``special_ids`` (and optionally ``period_ids``).
    Segments come from ``token_type_ids``; when those are missing (RoBERTa, DistilBERT) they
    are derived from the separator token (``tokenizer.sep_token_id`` or ``sep_id``).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [b, n], got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError("attention_mask must have the same [b, n] shape as input_ids")
    if token_type_ids is not None and token_type_ids.shape != input_ids.shape:
        raise ValueError("token_type_ids must have the same [b, n] shape as input_ids")
    if special_ids is None:
        if tokenizer is None:
            raise ValueError("token_infos needs a tokenizer or explicit special_ids=[...]")
        words = {tokenizer.unk_token_id, getattr(tokenizer, "mask_token_id", None)}
        special_ids = [i for i in tokenizer.all_special_ids if i not in words]
    if sep_id is None and tokenizer is not None:
        sep_id = tokenizer.sep_token_id
    special_t = torch.tensor(sorted(set(special_ids)), dtype=torch.long)
    period_t = torch.tensor(sorted(set(period_ids or ())), dtype=torch.long)
    out: list[TokenInfo] = []
    for i in range(input_ids.shape[0]):
        keep = attention_mask[i].nonzero().flatten().long()  # [n_i]
        ids = input_ids[i, keep].long().cpu()  # [n_i]
        toks = tuple(tokenizer.convert_ids_to_tokens(ids.tolist())) if tokenizer else None
        period = torch.isin(ids, period_t)
        if toks is not None:
            period |= torch.tensor([t.lstrip("Ġ▁") == "." for t in toks], dtype=torch.bool)
        if token_type_ids is not None:
            segment = token_type_ids[i, keep].long().cpu()
        elif sep_id is not None:
            segment = _segments_from_separators(ids == sep_id)
        else:
            segment = None
        special = torch.isin(ids, special_t)
        out.append(TokenInfo(keep.cpu(), special, period, segment, toks))
    return out
