"""Peers in the same benchmark run: other libraries' attention modules at our shapes.

A peer is named like a mechanism spec with an ``hf_`` prefix, e.g.
``hf_nystromformer(num_landmarks=64)``. Each is the module transformers ships, built from
a local random config (no download): only its attention core is timed, because its
query / key / value projections are replaced by copies of one input (``_Copy``), the
same way ``peer_pair`` feeds our mechanism. Both sides therefore get one leaf tensor
x [b, n, h*d] whose gradient is the only one computed, and three fresh q, k, v copies
(what a projection would produce).

Peers (transformers module; parameters; what it computes):
* ``hf_longformer(window, global_tokens)``: ``LongformerSelfAttention``, one-sided window
  ``window`` and the first ``global_tokens`` positions global (the key sets of our
  ``band(window)`` and ``longformer(window, global_tokens=(0, ..))``, tested equal).
* ``hf_bigbird(block, random_blocks)``: ``BigBirdBlockSparseAttention`` (``block_sparse``).
  Run in eval mode, as every peer, where transformers draws no random blocks (each is block
  0): the work of ``ours_for``'s layout, with the first block in place of the random ones.
* ``hf_nystromformer(num_landmarks, conv_kernel)``: ``NystromformerSelfAttention``.
* ``hf_reformer_lsh(buckets, chunk, num_hashes)``: ``LSHSelfAttention`` (one chunk before,
  none after; shared query-key).
* ``flex_band(window)``, ``flex_longformer(window, global_tokens)``: torch's compiled
  ``flex_attention`` with a ``BlockMask`` made from the pattern written as a closed-form
  ``mask_mod`` (|i - j| <= window, or'ed with the first ``global_tokens`` rows and columns),
  the way a FlexAttention user writes it: no [n, n] lookup table. The block mask is built
  and the kernel compiled by the first call, a warm-up at the measured length that
  ``bench.speed`` runs before the peak-memory mark is reset. On CPU (torch 2.13)
  FlexAttention has no backward: these peers are forward-only there (``forward_only``).
  ``compiled=0`` runs eager FlexAttention (slow; for the tests' equalities).

``ours_for(peer)`` names the mechanism spec with the same key sets (or, for the
approximations, the same budget), so a table can put each peer beside ours.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from ..core.spec import parse_spec
from ..mechanisms import compiled_flex_attention, flex_recompile_limit

PEER_PREFIXES = ("hf_", "flex_")


class _Place:
    """Where a peer runs: its module's parameters and buffers and its masks go to
    ``device`` in ``dtype`` (floating tensors only), as the measured input x is."""

    def __init__(self, device: str | torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = torch.device(device), dtype

    def module(self, m: nn.Module) -> nn.Module:
        return m.to(self.device, self.dtype)

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, self.dtype if t.is_floating_point() else t.dtype)


# peer name -> (default parameters, builder(params, heads, head_dim, n, place))
_Builder = Callable[[dict[str, Any], int, int, int, _Place],
                    Callable[[torch.Tensor], torch.Tensor]]


class _Copy(nn.Module):
    """Stands in for a projection: a fresh copy of the input (or of one slice of it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


def _no_projections(module: nn.Module, *names: str) -> nn.Module:
    for name in names:
        setattr(module, name, _Copy())
    return module.eval()


def _longformer(p: dict[str, Any], heads: int, head_dim: int, n: int, place: _Place):
    from transformers import LongformerConfig
    from transformers.models.longformer.modeling_longformer import LongformerSelfAttention

    window = int(p["window"])
    cfg = LongformerConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                           attention_window=[2 * window], attention_probs_dropout_prob=0.0)
    att = _no_projections(LongformerSelfAttention(cfg, layer_id=0), "query", "key", "value")
    g = int(p.get("global_tokens", 0))
    if g:
        _no_projections(att, "query_global", "key_global", "value_global")
    place.module(att)

    def run(x: torch.Tensor) -> torch.Tensor:
        mask = x.new_zeros(x.shape[0], n)  # [b,n]
        mask[:, :g] = 1.0  # 0 local, > 0 global (the model's convention after its own remap)
        return att(x, attention_mask=mask, is_index_masked=mask < 0,
                   is_index_global_attn=mask > 0, is_global_attn=bool(g))[0]

    return run


def _bigbird(p: dict[str, Any], heads: int, head_dim: int, n: int, place: _Place):
    from transformers import BigBirdConfig
    from transformers.models.big_bird.modeling_big_bird import (
        BigBirdBlockSparseAttention,
        BigBirdModel,
    )

    block = int(p["block"])
    cfg = BigBirdConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                        block_size=block, num_random_blocks=int(p["random_blocks"]),
                        max_position_embeddings=max(n, 4096), attention_type="block_sparse")
    att = place.module(_no_projections(BigBirdBlockSparseAttention(cfg, seed=0), "query", "key",
                                       "value"))
    masks = [place.tensor(m) for m in
             BigBirdModel.create_masks_for_block_sparse_attn(torch.ones(1, n), block)]

    def run(x: torch.Tensor) -> torch.Tensor:
        blocked, band, from_mask, to_mask = (m.expand(x.shape[0], *m.shape[1:]) for m in masks)
        return att(x, band_mask=band, from_mask=from_mask, to_mask=to_mask,
                   from_blocked_mask=blocked, to_blocked_mask=blocked)[0]

    return run


def _nystromformer(p: dict[str, Any], heads: int, head_dim: int, n: int, place: _Place):
    from transformers import NystromformerConfig
    from transformers.models.nystromformer.modeling_nystromformer import (
        NystromformerSelfAttention,
    )

    kernel = int(p.get("conv_kernel", 0))
    cfg = NystromformerConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                              num_landmarks=int(p["num_landmarks"]), segment_means_seq_len=n,
                              conv_kernel_size=kernel or 1, attention_probs_dropout_prob=0.0)
    att = _no_projections(NystromformerSelfAttention(cfg), "query", "key", "value")
    if not kernel:  # the config type wants an int; the module skips the conv when None
        cast(Any, att).conv_kernel_size = None  # a plain attribute, not a Tensor/Module
        del att.conv
    place.module(att)

    def run(x: torch.Tensor) -> torch.Tensor:
        return att(x)[0]

    return run


def _reformer_lsh(p: dict[str, Any], heads: int, head_dim: int, n: int, place: _Place):
    from transformers import ReformerConfig
    from transformers.models.reformer.modeling_reformer import LSHSelfAttention

    cfg = ReformerConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                         attention_head_size=head_dim, num_buckets=int(p["buckets"]),
                         lsh_attn_chunk_length=int(p["chunk"]), num_hashes=int(p["num_hashes"]),
                         lsh_num_chunks_before=1, lsh_num_chunks_after=0, is_decoder=False,
                         max_position_embeddings=n, hash_seed=0,
                         lsh_attention_probs_dropout_prob=0.0)
    att = place.module(_no_projections(LSHSelfAttention(cfg), "query_key", "value"))

    def run(x: torch.Tensor) -> torch.Tensor:
        return att(x)[0]

    return run


def _flex(global_default: int) -> _Builder:
    def build(p: dict[str, Any], heads: int, head_dim: int, n: int, place: _Place):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        window, g = int(p["window"]), int(p.get("global_tokens", global_default))

        def mask_mod(b, h, qi, kj):  # the pattern, closed form (no lookup table)
            allowed = (qi - kj).abs() <= window
            return allowed | (qi < g) | (kj < g) if g else allowed

        masks: dict[str, Any] = {}  # device -> BlockMask, built once
        flex = compiled_flex_attention() if p["compiled"] else flex_attention

        def run(x: torch.Tensor) -> torch.Tensor:
            b, dev = x.shape[0], str(x.device)
            if dev not in masks:
                masks[dev] = create_block_mask(mask_mod, None, None, n, n, device=dev)
            heads_view = x.view(b, n, heads, head_dim).transpose(1, 2)  # [b,h,n,d]
            q, k, v = (heads_view.clone() for _ in range(3))
            with flex_recompile_limit():  # one compiled graph per (n, grad mode) of a run
                out = flex(q, k, v, block_mask=masks[dev])  # [b,h,n,d]
            return out.transpose(1, 2).reshape(b, n, heads * head_dim)

        return run

    return build


PEERS: dict[str, tuple[dict[str, Any], _Builder]] = {
    "hf_longformer": ({"window": 64, "global_tokens": 0}, _longformer),
    "hf_bigbird": ({"block": 64, "random_blocks": 3}, _bigbird),
    "hf_nystromformer": ({"num_landmarks": 64, "conv_kernel": 0}, _nystromformer),
    "hf_reformer_lsh": ({"buckets": 64, "chunk": 64, "num_hashes": 1}, _reformer_lsh),
    "flex_band": ({"window": 128, "compiled": 1}, _flex(0)),
    "flex_longformer": ({"window": 128, "global_tokens": 1, "compiled": 1}, _flex(1)),
}


def is_peer(method: str) -> bool:
    return method.startswith(PEER_PREFIXES)


def is_flex(method: str) -> bool:
    """A compiled FlexAttention peer (it compiles per shape: warm it up at the measured n)."""
    return method.startswith("flex_")


def forward_only(method: str, device: str) -> bool:
    """Whether a method has no backward on ``device`` (FlexAttention on CPU, torch 2.13)."""
    return is_flex(method) and not device.startswith("cuda")


def ours_for(method: str) -> str | None:
    """Our mechanism spec with the same key sets as peer ``method`` (same budget for the
    approximations), or None for a name that is not a peer."""
    if not is_peer(method):
        return None
    name, kwargs = parse_spec(method)
    if name not in PEERS:
        return None
    p = {**PEERS[name][0], **kwargs}
    if name in ("hf_longformer", "flex_band", "flex_longformer"):
        g = int(p.get("global_tokens", 0))
        if not g:
            return f"band(window={p['window']})"
        return f"longformer(window={p['window']}, global_tokens={tuple(range(g))})"
    if name == "hf_bigbird":
        # transformers' ITC layout: the first and the last block global
        return (f"bigbird(block={p['block']}, num_random_blocks={p['random_blocks']}, "
                "last_global=True)")
    if name == "hf_nystromformer":
        return f"nystrom(num_landmarks={p['num_landmarks']}, conv_kernel={p['conv_kernel']})"
    return f"lsh(buckets={p['buckets']}, chunk={p['chunk']}, num_hashes={p['num_hashes']})"


def build_peer(method: str, heads: int, head_dim: int, n: int,
               device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
               ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``run(x [b, n, h*d]) -> [b, n, h*d]`` for a peer spec such as
    ``hf_nystromformer(num_landmarks=64)``, its module and masks on ``device`` in ``dtype``
    (x's); unknown names or parameters are a ValueError."""
    name, params = peer_params(method)
    return PEERS[name][1](params, heads, head_dim, n, _Place(device, dtype))


def peer_params(method: str) -> tuple[str, dict[str, Any]]:
    """(name, parameters with the defaults filled in) of a peer spec; unknown names or
    parameters are a ValueError naming what the peer takes."""
    name, kwargs = parse_spec(method)
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; choose one of {', '.join(sorted(PEERS))}")
    defaults = PEERS[name][0]
    unknown = set(kwargs) - set(defaults)
    if unknown:
        raise ValueError(f"unknown parameter(s) {sorted(unknown)} for peer {name!r}; it takes "
                         f"{', '.join(sorted(defaults))}")
    return name, {**defaults, **kwargs}


def ours_on_one_input(mech: nn.Module, ctx: Any, heads: int, head_dim: int
                      ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Our mechanism fed like a peer: x [b, n, h*d] -> three copies as q, k, v [b,h,n,d]."""

    def run(x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        heads_view = x.view(b, n, heads, head_dim).transpose(1, 2)  # [b,h,n,d]
        q, k, v = (heads_view.clone() for _ in range(3))
        return mech(q, k, v, ctx).out.transpose(1, 2).reshape(b, n, heads * head_dim)

    return run
