"""Key/value prefixes in the "attnlab" attention call: the machinery of deep prefix tuning.

Prefix tuning (Li & Liang, "Prefix-Tuning: Optimizing Continuous Prompts for Generation",
ACL 2021; every layer, as P-tuning v2, Liu et al. ACL 2022) gives each layer l's attention
p extra trained keys and values in front of the tokens' own::

    K'_l = [P_k^l ; K_l]    V'_l = [P_v^l ; V_l]      # [b, h, p + m, d]

and every query may attend every prefix position (padding masks only the tokens). attnlab
owns the attention call, so the prefix is prepended there (:func:`extend_kv`, called by
``hf.backend.attnlab_attention``), not passed as a key/value cache through the host's
``forward`` (whose cache argument changes between transformers releases).

:class:`PrefixEncoder` holds P for all layers: an embedding table, optionally
reparameterised by an MLP as Li & Liang (section 4.3): P = MLP(P'), P' [p, hidden],
MLP = Linear(hidden, mid) -> tanh -> Linear(mid, L * 2 * hidden). Its flat output
[p, L * 2 * h * d] is laid out as peft's ``PrefixEncoder`` (layer l's keys at slot 2l, values
at 2l + 1), so the same weights give the same prefix as peft's and its state loads unchanged.

Position ids: when the host model is given a key/value cache of length p, Hugging Face BERT
and RoBERTa number the tokens from p (positions p .. p + n - 1), and so did P-tuning v2 and
peft's prefix tuning on them. ``shift_positions=True`` keeps that numbering (the host's
embeddings get the prefix length as their cache length); False numbers tokens from 0.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .arch import Host

PREFIX_ATTR = "_attnlab_prefix"  # attention-module attribute: a PrefixRef (plain object)
ENCODER_ATTR = "attnlab_prefix"  # base-model submodule: the PrefixEncoder
CACHE_LENGTH_ARGS = ("cache_length", "past_key_values_length")  # transformers >= 5.24, older


class PrefixEncoder(nn.Module):
    """P for every layer: ``forward() -> [L, 2, h, p, d]`` (keys at [:, 0], values at [:, 1]).

    num_layers L, num_heads h, head_dim d, length p; mid: hidden size of the
    reparameterising MLP (None: P is the embedding table itself).
    """

    def __init__(self, num_layers: int, num_heads: int, head_dim: int, length: int,
                 mid: int | None = None) -> None:
        super().__init__()
        self.shape = (num_layers, num_heads, length, head_dim)
        width = num_heads * head_dim  # hidden size of the host
        flat = num_layers * 2 * width
        self.embedding = nn.Embedding(length, width if mid is not None else flat)
        self.transform = (None if mid is None else
                          nn.Sequential(nn.Linear(width, mid), nn.Tanh(), nn.Linear(mid, flat)))

    def forward(self) -> torch.Tensor:
        L, h, p, d = self.shape
        x = self.embedding.weight  # [p, L*2*h*d] or [p, h*d]
        if self.transform is not None:
            x = self.transform(x)  # [p, L*2*h*d]
        return x.view(p, L, 2, h, d).permute(1, 2, 3, 0, 4)  # [L, 2, h, p, d]

    def extra_repr(self) -> str:
        L, h, p, d = self.shape
        return f"layers={L}, heads={h}, length={p}, head_dim={d}"


class PrefixRef:
    """Plain attribute on an attention module: which encoder and layer give its prefix
    (a plain object, not a submodule, so the encoder's weights are saved once)."""

    def __init__(self, encoder: PrefixEncoder, layer: int) -> None:
        self.encoder, self.layer = encoder, layer

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(P_k, P_v) of this layer, each [h, p, d]."""
        pk, pv = self.encoder()[self.layer]  # [2, h, p, d] -> 2 x [h, p, d]
        return pk, pv


def extend_kv(module: nn.Module, key: torch.Tensor, value: torch.Tensor,
              key_mask: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Prepend ``module``'s prefix (if it has one) to key [b,h,m,d], value [b,h,m,d] and the
    key mask [b,m] (prefix positions are always kept). Returns them unchanged otherwise."""
    ref: PrefixRef | None = getattr(module, PREFIX_ATTR, None)
    if ref is None:
        return key, value, key_mask
    b = key.shape[0]
    pk, pv = ref.kv()  # [h, p, d] each
    p = pk.shape[1]
    key = torch.cat([pk.to(key.dtype).expand(b, -1, -1, -1), key], dim=2)  # [b,h,p+m,d]
    value = torch.cat([pv.to(value.dtype).expand(b, -1, -1, -1), value], dim=2)
    if key_mask is not None:
        keep = key_mask.new_ones(b, p)  # [b,p]
        key_mask = torch.cat([keep, key_mask], dim=1)  # [b,p+m]
    return key, value, key_mask


def _cache_length_arg(embeddings: nn.Module) -> str | None:
    params = inspect.signature(embeddings.forward).parameters
    return next((a for a in CACHE_LENGTH_ARGS if a in params), None)


def _shift_hook(length: int, arg: str):
    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        kwargs[arg] = length  # positions start after the prefix
        return args, kwargs

    return hook


def install_prefix(host: Host, length: int, mid: int | None, shift_positions: bool
                   ) -> PrefixEncoder:
    """Put a new PrefixEncoder on ``host.base`` and point every attention module at it.

    Raises ValueError (nothing changed) when positions should shift but the host's
    embeddings take no cache length.
    """
    embeddings = getattr(host.base, "embeddings", None)
    arg = _cache_length_arg(embeddings) if isinstance(embeddings, nn.Module) else None
    if shift_positions and arg is None:
        raise ValueError(
            f"{type(host.base).__name__}'s embeddings take no cache length, so token "
            "positions cannot start after the prefix; use prefix(shift_positions=False)"
        )
    if getattr(host.base, ENCODER_ATTR, None) is not None:
        raise ValueError("this model already has a prefix; apply prefix tuning once")
    encoder = PrefixEncoder(host.num_layers, host.num_heads, host.head_dim, length, mid)
    host.base.add_module(ENCODER_ATTR, encoder)
    for layer, attn in enumerate(host.attention):
        setattr(attn, PREFIX_ATTR, PrefixRef(encoder, layer))
    if shift_positions:
        assert embeddings is not None and arg is not None  # arg None raised above
        embeddings.register_forward_pre_hook(_shift_hook(length, arg), with_kwargs=True)
    return encoder
