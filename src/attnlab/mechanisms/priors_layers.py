"""Attention maps taken from lower layers: predicted by a convolution (``predictive``) or
reused as they are (``lazyformer``).

Survey: Lin, Wang, Liu, Qiu, "A Survey of Transformers", AI Open 2022, §4.5 ("prior from
lower modules"). Both pass their map up the stack through ``AttnContext.state`` with the
helpers of ``priors.py`` (RealFormer's pattern): an entry keyed by the mechanism, carrying
the layer index that wrote it; an entry from the same or a later layer, or of another shape,
is a clear error. Both have scope "layer": head t of one layer feeds head t of the next.
Under Hugging Face gradient checkpointing the backend replays the state of each layer for
its recomputation (``attnlab.hf.backend.Replay``), so gradients equal those without it.

Shapes in comments: b batch, h heads, n query length, m key length, d head dim, dv value
head dim, k convolution kernel size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..core import (
    AttnContext,
    AttnOutput,
    Capabilities,
    HeadDims,
    MechanismConfig,
    check_qkv,
    register_mechanism,
    require,
)
from ._rowchunks import allowed_pairs, attend_rows, draws_dropout, in_row_chunks, rows_per_chunk
from .dense import Softmax, SoftmaxConfig
from .priors import ResidualScores, lower_entry

FAMILY = "priors"

# Keys of the entries in ``AttnContext.state``.
PREDICTIVE_STATE_KEY = "predictive.scores"  # value: ResidualScores (masked pairs zeroed)
LAZYFORMER_STATE_KEY = "lazyformer.map"  # value: LazyMap


def _same_shape(name: str, layer_idx: int, what: str, want: torch.Size,
                got: torch.Size, prev_layer: int) -> None:
    require(got == want,
            f"{name} at layer {layer_idx} needs {what} of shape {list(want)} but layer "
            f"{prev_layer} passed up {list(got)}; every {name} layer needs the same "
            f"heads and lengths (put it on all heads of its layers, with equal head counts)")


# ------------------------------------------------------------------------------- predictive


@dataclass(frozen=True, kw_only=True)
class PredictiveConfig(MechanismConfig):
    name: ClassVar[str] = "predictive"
    alpha: float = 0.5  # alpha: weight of this layer's Q K^T / sqrt(d) (1 - alpha: prediction)
    kernel: int = 3  # k: size of the k x k convolution over the lower layer's scores

    def __post_init__(self) -> None:
        require(math.isfinite(self.alpha) and 0.0 <= self.alpha <= 1.0,
                f"predictive alpha must be in [0, 1] (the weight of the dot-product scores), "
                f"got {self.alpha}; alpha=1 is plain softmax, e.g. alpha=0.5")
        require(self.kernel >= 1 and self.kernel % 2 == 1,
                f"predictive kernel must be an odd size >= 1 (a centred k x k convolution), "
                f"got {self.kernel}; e.g. kernel=3")


@register_mechanism(PredictiveConfig)
class Predictive(nn.Module):
    """Predictive attention: this layer's scores mixed with a convolution of the lower ones.

    Paper: Wang, Yang, Bai, Zhang, Bai, Yu, Zhang, Tong, "Predictive Attention Transformer:
    Improving Transformer with Attention Map Prediction", 2021 (ICLR 2021 submission; the
    follow-up is "Evolving Attention with Residual Convolutions", ICML 2021).
    Formula (S_{l-1} the lower predictive layer's pre-softmax scores [b,h,n,m], the heads as
    the convolution's channels):
        S_l = alpha * Q K^T / sqrt(d) + (1 - alpha) * Conv2d_{h -> h, k x k}(S_{l-1})
        out = softmax(S_l + mask) V
    The first predictive layer of a forward pass (no entry in ``ctx.state``, or ``state``
    None) has no lower map and uses S_l = Q K^T / sqrt(d) (plain softmax). alpha = 1 is
    plain softmax in every layer (tested). Parameters: one ``nn.Conv2d(h, h, k)`` (weight
    and bias) per layer, PyTorch's default init from the global torch RNG; the first
    layer's convolution is built but unused, and the bias, a constant per head, cancels in
    this layer's softmax (it reaches the next layer's prediction only through the zero
    padding at the borders). Complexity O(n*m*(d + h*k^2)).
    Cross-layer state: S_l is stored in ``ctx.state["predictive.scores"]`` with the layer
    index, with the pairs a query may not see (padded keys, padded query rows when n == m,
    future keys when causal) set to 0, the convolution's own zero padding: a padded
    sequence then predicts exactly what the unpadded one does, and no masked score enters
    the next layer. Causal: the kernel's rows cover queries i-k+1..i (the convolution is
    causal along the query axis), so nothing from a later token leaks.
    Deviations: the formula as stated above (alpha weighs the dot product); the paper's
    exact mixing and any residual term around the convolution are not reproduced.
    ``need_weights`` returns the probabilities; ``ctx.dropout`` applies to them in training.
    Memory: without ``need_weights`` the query rows run in chunks under activation
    checkpoints (``_rowchunks``); each chunk gets its rows of S_{l-1} and the rows around
    them that the kernel reads (one ``index_select``), and returns its rows of S_l. Training
    then keeps S_l, which the next layer reads, and none of the softmax's [b,h,n,m]
    tensors or the prediction.
    """

    example: ClassVar[str] = "predictive(alpha=0.5, kernel=3)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Wang et al. 2021", scope="layer", keys_are_tokens=True,
        complexity="O(n*m*(d+h*k^2))",
    )

    def __init__(self, cfg: PredictiveConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        h = dims.num_heads
        self.conv = nn.Conv2d(h, h, cfg.kernel)  # weight [h,h,k,k], bias [h]

    def halo(self, causal: bool) -> tuple[int, int]:
        """(rows above, rows below) of the lower map that one output row's kernel reads."""
        k = self.cfg.kernel
        return (k - 1, 0) if causal else (k // 2, k // 2)  # causal: queries i-k+1..i only

    def predict(self, lower: torch.Tensor, above: torch.Tensor | None,
                below: torch.Tensor | None) -> torch.Tensor:
        """Conv2d over rows of the lower scores [b,h,c,m] (masked pairs 0) -> [b,h,c,m]:
        ``above`` [b,h,t,m] and ``below`` [b,h,u,m] are the lower map's rows around them
        (``halo``; rows beyond the map are 0, the convolution's zero padding), None for
        none."""
        half = self.cfg.kernel // 2
        x = torch.cat([t.to(lower.dtype) for t in (above, lower, below) if t is not None],
                      dim=2)
        # channels-last: with h channels only, the CPU's oneDNN convolution is several
        # times faster on this layout than on the default one (same values)
        x = F.pad(x, (half, half)).contiguous(memory_format=torch.channels_last)
        bias = self.conv.bias
        assert bias is not None  # nn.Conv2d built with its default bias=True
        out = F.conv2d(x, self.conv.weight.to(x.dtype), bias.to(x.dtype))  # [b,h,c,m]
        return out.contiguous()

    def halos(self, lower: torch.Tensor | None, causal: bool, n: int, rows: int
              ) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Per chunk of ``rows`` of the n query rows (from row 0): the lower map's rows
        above and below it that the kernel reads (``halo``), 0 beyond the map; (None, None)
        without a lower map or rows to read. All are gathered by one ``index_select``, whose
        backward writes the lower map's gradient once."""
        top, bottom = self.halo(causal)
        index: list[int] = []
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            index += list(range(r0 - top, r0)) + list(range(r1, r1 + bottom))
        if lower is None or not index:
            return [(None, None)] * len(range(0, n, rows))
        idx = torch.tensor(index, device=lower.device)
        inside = ((idx >= 0) & (idx < n)).to(lower.dtype)[:, None]  # [t,1]
        rows_around = lower.index_select(2, idx.clamp(0, n - 1)) * inside  # [b,h,t,m]
        cuts = rows_around.split(top + bottom, dim=2)
        return [(cut[:, :, :top] if top else None, cut[:, :, top:] if bottom else None)
                for cut in cuts]

    def _rows(self, first_row: int, num_queries: int, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, ctx: AttnContext, lower: torch.Tensor | None,
              above: torch.Tensor | None, below: torch.Tensor | None, keep_scores: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(out [b,h,c,dv], S_l with unseen pairs 0 [b,h,c,m] or None, probabilities
        [b,h,c,m]) of query rows first_row .. of num_queries (q [b,h,c,d]: those rows;
        lower: their rows of S_{l-1}, or None for plain scores; above, below: its rows
        around them)."""
        scores = (q @ k.transpose(-1, -2)) * ctx.scale_for(q.shape[-1])  # [b,h,c,m]
        if lower is not None:
            pred = self.predict(lower.to(scores.dtype), above, below)  # [b,h,c,m]
            scores = self.cfg.alpha * scores + (1.0 - self.cfg.alpha) * pred
        out, probs = attend_rows(scores, v, ctx, self.training, first_row, num_queries)
        stored = None
        if keep_scores:
            keep = allowed_pairs(ctx, scores.shape, q.device, first_row, num_queries)
            if ctx.key_mask is not None and num_queries == k.shape[-2]:  # padded query rows
                rows = ctx.key_mask[:, first_row:first_row + q.shape[2]]
                keep = keep & rows[:, None, :, None].to(torch.bool)
            stored = scores.masked_fill(~keep, 0.0)
        return out, stored, probs

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        b, h, n, _ = q.shape
        m = k.shape[-2]
        prev: ResidualScores | None = lower_entry(ctx.state, PREDICTIVE_STATE_KEY,
                                                  "predictive", ctx.layer_idx, "scores")
        lower = None
        if prev is not None:
            _same_shape("predictive", ctx.layer_idx, "lower scores [b,h,n,m]",
                        torch.Size((b, h, n, m)), prev.scores.shape, prev.layer_idx)
            if self.cfg.alpha < 1.0:
                lower = prev.scores
        keep = ctx.state is not None
        if ctx.need_weights:
            above, below = self.halos(lower, ctx.causal, n, n)[0]
            out, scores, probs = self._rows(0, n, q, k, v, ctx, lower, above, below, keep)
        else:  # query rows in checkpointed chunks (_rowchunks): of the [b,h,n,m] tensors
            # training keeps only S_l, which the next layer reads
            probs = None
            rows = rows_per_chunk(b, h, m)
            around = self.halos(lower, ctx.causal, n, rows)
            # The checkpointed chunks hold this closure until the backward; a context with
            # the state would close a cycle through autograd's C++ nodes (state -> S_l ->
            # its checkpoint -> closure -> state) that no collector frees, keeping every
            # training step's graph alive. The rows need no state.
            rows_ctx = replace(ctx, state=None)

            def chunk(r0: int, q_rows: torch.Tensor, lower_rows: torch.Tensor | None,
                      above: torch.Tensor | None, below: torch.Tensor | None):
                out, stored, _ = self._rows(r0, n, q_rows, k, v, rows_ctx, lower_rows,
                                            above, below, keep)
                return (out, stored) if keep else out

            result = in_row_chunks(chunk, q, m, dropout=draws_dropout(ctx, self.training),
                                   row_inputs=(lower,), chunk_inputs=around,
                                   concat_extras=True)
            out, scores = result if keep else (result, None)
        if keep:
            assert ctx.state is not None and scores is not None
            ctx.state[PREDICTIVE_STATE_KEY] = ResidualScores(scores, ctx.layer_idx)
        return AttnOutput(out, probs)


# ------------------------------------------------------------------------------- lazyformer


class LazyMap(NamedTuple):
    """What a lazy block's first layer passes up: its queries [b,h,n,d] and keys [b,h,m,d],
    from which the map P_c is computed again where it is reused (the same function of the
    same tensors: the same map), its values [b,h,m,dv] when ``share_values`` (else None),
    and that layer's index."""

    q: torch.Tensor
    k: torch.Tensor
    values: torch.Tensor | None
    layer_idx: int


@dataclass(frozen=True, kw_only=True)
class LazyformerConfig(MechanismConfig):
    name: ClassVar[str] = "lazyformer"
    share: int = 2  # layers per lazy block: the map is computed once every `share` layers
    share_values: bool = False  # lazy layers also reuse the block's first-layer values V

    def __post_init__(self) -> None:
        require(self.share >= 1, f"lazyformer share must be >= 1 (layers per lazy block; 1 "
                f"computes the map in every layer), got {self.share}; e.g. share=2")


@register_mechanism(LazyformerConfig)
class Lazyformer(nn.Module):
    """LazyFormer: the attention map is computed once per lazy block and reused above it.

    Paper: Ying, Ke, He, Liu, "LazyFormer: Self Attention with Lazy Update", arXiv
    2102.12702, 2021.
    Formula: a lazyformer layer l computes P_l = softmax(Q K^T / sqrt(d) + mask) when no
    lower lazyformer layer of this forward computed a map, or the last one that did (layer
    c) is ``share`` or more layers below (l - c >= share); otherwise it is lazy and reuses
    P_c. out = P V with this layer's V, or with V_c too when ``share_values`` (the value
    path reused as well, so the layer's attention output is layer c's). Blocks are counted
    in layer indices: on layers 0..5 with share=2, layers 0, 2, 4 compute and 1, 3, 5 reuse.
    share=1 is plain softmax in every layer (tested). Lazy layers read neither q nor k (the
    host's Q/K projections of those layers get no gradient, as the paper drops them);
    gradients of a lazy layer flow into P_c. Complexity O(n*m*d) time in every layer (lazy
    layers compute P_c V again, see below), O(n + m) memory kept per layer. No
    parameters.
    Cross-layer state: ``ctx.state["lazyformer.map"]`` holds the LazyMap of the last
    computing layer: not P_c itself but its queries and keys. A lazy layer computes
    P_c V again from them with the ``softmax`` mechanism (``F.scaled_dot_product_attention``:
    a flash kernel on the CPU), so no layer keeps a [b,h,n,m] map for the backward; the
    value is P_c V all the same and the gradients reach q_c and k_c as they would through
    P_c. The masks (padding, causal) and the scale are the lazy layer's context's, which in
    one forward pass are the computing layer's. Shape mismatches are a clear error. Dropout
    ``ctx.dropout`` applies to the probabilities in each layer, in training. Deviations:
    the paper's training tricks (e.g. where the computing layers sit in a pre-trained
    model) are left to the plan. ``need_weights`` returns the map the layer used (P_c in
    lazy layers, computed as the ``softmax`` mechanism returns its weights).
    """

    example: ClassVar[str] = "lazyformer(share=2)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Ying et al. 2021", scope="layer", complexity="O(n*m)",
    )

    def __init__(self, cfg: LazyformerConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        self.softmax = Softmax(SoftmaxConfig(), dims)  # no parameters: P V of every layer

    def lower_map(self, ctx: AttnContext) -> LazyMap | None:
        """The map this layer reuses (None: it computes its own)."""
        prev: LazyMap | None = lower_entry(ctx.state, LAZYFORMER_STATE_KEY, "lazyformer",
                                           ctx.layer_idx, "an attention map")
        if prev is None or ctx.layer_idx - prev.layer_idx >= self.cfg.share:
            return None
        return prev

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        b, h, n, _ = q.shape
        m = k.shape[-2]
        prev = self.lower_map(ctx)
        if prev is None:  # computing layer: P_l = softmax(Q K^T / sqrt(d) + mask)
            if ctx.state is not None:
                ctx.state[LAZYFORMER_STATE_KEY] = LazyMap(
                    q, k, v if self.cfg.share_values else None, ctx.layer_idx)
            return self.softmax(q, k, v, ctx)
        # lazy layer: P_c (from q_c, k_c) with this layer's V, or V_c
        _same_shape("lazyformer", ctx.layer_idx, "a map [b,h,n,m]",
                    torch.Size((b, h, n, m)), torch.Size((*prev.q.shape[:3], prev.k.shape[-2])),
                    prev.layer_idx)
        values = v
        if prev.values is not None:
            _same_shape("lazyformer", ctx.layer_idx, "values [b,h,m,dv]", v.shape,
                        prev.values.shape, prev.layer_idx)
            values = prev.values.to(v.dtype)  # [b,h,m,dv]
        return self.softmax(prev.q.to(q.dtype), prev.k.to(q.dtype), values, ctx)

