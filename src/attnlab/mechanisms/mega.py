"""MEGA: single-head gated attention equipped with a multi-dimensional damped EMA.

Paper: Ma, Zhou, Kong, He, Gui, Neubig, May, Zettlemoyer, "Mega: Moving Average Equipped
Gated Attention", ICLR 2023. Official code: facebookresearch/mega,
``fairseq/modules/moving_average_gated_attention.py`` (the layer),
``exponential_moving_average.py`` (the EMA, here ``_ema.DampedEMA``) and
``relative_positional_bias.py`` (the simple relative bias).

Shapes in comments: b batch, h heads, n length, d head dim, D = h*d model channels,
z shared Q/K size, v (``hv``) value size, c chunk, nc number of chunks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..core import (
    OMIT_DEFAULT,
    AttnContext,
    AttnOutput,
    Capabilities,
    HeadDims,
    MechanismConfig,
    check_qkv,
    register_mechanism,
    require,
)
from ._ema import DampedEMA

FAMILY = "mega"

# The official Laplace attention function's constants: mu = sqrt(1/2), sigma = sqrt(1/(4 pi))
# (chosen so that f_laplace approximates relu^2 near the origin; official ``utils.laplace``).
LAPLACE_MU = math.sqrt(0.5)
LAPLACE_SIGMA = math.sqrt(0.25 / math.pi)


def _drop(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Elementwise dropout of the layer's own (``MegaConfig.dropout``, ``hidden_dropout``)."""
    return F.dropout(x, p, training=True) if training and p > 0 else x


def laplace(x: torch.Tensor) -> torch.Tensor:
    """f_laplace(x) = 0.5 * (1 + erf((x - mu) / (sigma sqrt 2))), elementwise."""
    return 0.5 * (1.0 + torch.erf((x - LAPLACE_MU) / (LAPLACE_SIGMA * math.sqrt(2.0))))


@dataclass(frozen=True, kw_only=True)
class MegaConfig(MechanismConfig):
    name: ClassVar[str] = "mega"
    ndim: int = 16  # h (paper): EMA dimensions per channel (beta, eta in R^h; eq. 2-3)
    zdim: int = 64  # z: size of the shared representation Z, hence of Q and K (eq. 7-9)
    hdim: int | None = None  # v: size of V and of the reset gate (eq. 10, 12); None = 2*D
    attention_fn: Literal["softmax", "laplace"] = "softmax"  # f in eq. 11
    chunk: int | None = None  # c: MEGA-chunk's chunk size (linear cost); None = whole sequence
    # the official layer's own dropouts, in training (the host's attention dropout is the
    # official attention_dropout): ``dropout`` on X' (the EMA's output) and on H (eq. 14),
    # ``hidden_dropout`` on V (eq. 10); left out of the spec at 0
    dropout: float = field(default=0.0, metadata=OMIT_DEFAULT)
    hidden_dropout: float = field(default=0.0, metadata=OMIT_DEFAULT)

    def __post_init__(self) -> None:
        require(self.ndim >= 1, f"mega ndim must be >= 1 (EMA dimensions per channel), got "
                f"{self.ndim}; the paper uses 16")
        require(self.zdim >= 1, f"mega zdim must be >= 1 (the Q/K size z), got {self.zdim}; "
                "the paper uses 64-128")
        require(self.hdim is None or self.hdim >= 1, f"mega hdim must be >= 1 or None (= 2*D), "
                f"got {self.hdim}")
        require(self.attention_fn in ("softmax", "laplace"), f"mega attention_fn must be "
                f"'softmax' or 'laplace', got {self.attention_fn!r}")
        require(self.chunk is None or self.chunk >= 1, f"mega chunk must be >= 1 or None (no "
                f"chunking), got {self.chunk}; the paper's MEGA-chunk uses 128 or more")
        for name in ("dropout", "hidden_dropout"):
            p = getattr(self, name)
            require(0.0 <= p < 1.0, f"mega {name} must be in [0, 1), got {p}; the LRA "
                   "configurations of the paper use 0 to 0.1")


@register_mechanism(MegaConfig)
class Mega(nn.Module):
    """Moving-average equipped gated attention (MEGA, and MEGA-chunk with ``chunk``).

    Paper: Ma et al., "Mega: Moving Average Equipped Gated Attention", ICLR 2023 (§3).
    Formula, with X [n, D] the layer input (eq. numbers of the paper):
        X' = EMA(X)                                   (eq. 6; eq. 2-3, ``_ema.DampedEMA``)
        Z = silu(X' W_z + b_z)  [n, z]                (eq. 7)
        Q = kappa_q * Z + mu_q,  K = kappa_k * Z + mu_k   (eq. 8-9)
        V = silu(X W_v + b_v)   [n, v]                (eq. 10)
        O = f(Q K^T / tau(X) + b_rel) V               (eq. 11; one head)
        gamma = silu(X' W_gamma + b_gamma)  [n, v]    (eq. 12, reset gate)
        phi = sigmoid(X' W_phi + b_phi)     [n, D]    (eq. 13, update gate)
        H = silu(X' W_h + (gamma * O) U_h + b_h)      (eq. 14)
        Y = phi * H + (1 - phi) * X                   (eq. 15)
    f = softmax with tau = sqrt(z), or f = laplace (official ``utils.laplace``: 0.5 (1 +
    erf((x - mu) / (sigma sqrt 2))), mu = sqrt(1/2), sigma = sqrt(1/(4 pi))) with tau = the
    number of keys the query sees (the official length normalisation: unpadded keys of its
    chunk, or, causal, keys up to the query). b_rel is the official simple relative bias,
    b_rel[i, j] = w[P - 1 + j - i] with w [2P - 1] learned, P = ``chunk`` (or the host's
    maximum length without chunking). Sizes: z = ``zdim`` (64), v = ``hdim`` (default 2D,
    the paper's expansion of the value), EMA dimensions ``ndim`` (16). The EMA is
    bidirectional (a forward and a backward kernel, as official), causal when
    ``ctx.causal``; it is an FFT convolution of length 2n (float64 when causal, so no
    future input reaches a past output through rounding; ``DampedEMA.convolve``; a float64
    input runs in float64 throughout, the EMA included).
    MEGA-chunk (``chunk`` = c): attention only inside non-overlapping chunks of c tokens
    (the last one shorter when c does not divide n), while the EMA still runs over the
    whole sequence. Complexity O(n*c) with a chunk (plus the EMA's O(n log n) per channel),
    O(n^2) without.
    In attnlab's protocol (scope "module"): MEGA needs the layer input X, not per-head q and
    k, so X := the host's value projection with heads merged, X = v.transpose(1, 2)
    .reshape(b, n, h*d) (D = h*d). The host's q and k are not read (``reads_qk`` False:
    its Q and K projections get no gradient from this layer). W_z, W_v, W_gamma, W_phi,
    W_h, U_h, kappa, mu, the EMA and b_rel are parameters of this module (W_z, W_gamma,
    W_phi, W_h as one fused linear map of X'); Y [b, n, D] is split back into heads
    [b, h, n, d] and goes through the host's output projection (and, in BERT, its residual
    and LayerNorm). It owns every head of a layer (surgery refuses a plan that gives it
    part of one), replaces the attention between the host's projections, and changes no
    projection shape.
    Training memory: with gradients on, V, Q, K (eq. 7-10) and the gated output (eq.
    12-15) run under non-reentrant activation checkpoints, so autograd keeps X, X' and O
    instead of the gates' activations and recomputes those (a few elementwise passes and
    three small GEMMs) in the backward; the attention's own weights are kept.
    Init as official, from the global torch RNG: W_v, the fused X' map, U_h and kappa
    ~ N(0, 0.02), biases and mu 0, b_rel ~ N(0, 0.02); the EMA's own (``DampedEMA``).
    Padding (``ctx.key_mask``): padded positions are zeroed before the EMA and excluded as
    keys (as official); the output at padded positions is 0 (official leaves them as
    computed; they never reach a token), so a sequence of padding only gives zeros.
    ``ctx.dropout`` drops attention weights in training (the official attention dropout).
    ``need_weights``: the single-head map f(...) [n, n] (block-diagonal with chunks)
    broadcast to every head, rows of padded positions 0; out is not probs @ v (gates follow).
    ``dropout`` and ``hidden_dropout`` (default 0) are the official layer's own, in
    training: ``dropout`` on X' (before every map of it) and on H, ``hidden_dropout`` on V
    (official ``moving_average_gated_attention.py``: ``self.dropout(mx)``,
    ``self.hidden_dropout(v)``, ``self.dropout(h)``; elementwise, as its default without
    feature dropout). With either on, the checkpointed regions stash the RNG state so that
    the backward's recomputation draws the forward's masks.
    Deviations: the official layer's own normalisation (pre-/post-norm) and its residual
    input are the host's (X is the value projection of the host's normalised hidden
    state; the host's output projection, residual and LayerNorm follow Y); the score scale is MEGA's
    own (``ctx.scale``, the host's 1/sqrt(d), is not used); the Laplace normalisation
    counts visible keys, which equals the official count except for a causal layer with
    left padding; the official all-padding softmax row (uniform over the padding) is 0 here.
    Not implemented (official options): the rotary relative bias (``rel_pos_bias='rotary'``;
    the official default and every LRA configuration use the simple one, as here) and the EMA
    kernel truncation (``truncation``: the official LRA architectures cut the kernel to 1,024
    lags, 4,096 for Path-X; here it spans the whole sequence).
    ``caps`` per config, on the instance: ``needs_max_len`` (True without a chunk: the
    relative bias is then sized by the host's maximum length, and a longer input is refused)
    and the complexity. The class declares needs_max_len False so that a chunked config
    builds without a maximum length; the unchunked one refuses a missing one itself.
    """

    example: ClassVar[str] = "mega(ndim=4, zdim=16, chunk=8)"
    caps: ClassVar[Capabilities] = Capabilities(
        family=FAMILY, paper="Ma et al. 2023", scope="module", exact=False,
        keys_are_tokens=True, reads_qk=False,
        complexity="O(n^2) (O(n*c) with chunk=c)",
    )

    def __init__(self, cfg: MegaConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        D = dims.num_heads * dims.head_dim  # model channels
        span = cfg.chunk if cfg.chunk is not None else dims.max_len
        if span is None:
            raise ValueError("mega without chunk sizes its relative position bias by the host's "
                             "maximum length, but HeadDims.max_len is None; give max_len or "
                             "set chunk=c (then the bias is sized by the chunk)")
        # caps of this config: sized by the chunk when chunked, else by the host's max length
        vars(self)["caps"] = dataclasses.replace(
            type(self).caps, needs_max_len=cfg.chunk is None,
            complexity="O(n*c)" if cfg.chunk is not None else "O(n^2)")
        self.channels = D
        self.hv = cfg.hdim if cfg.hdim is not None else 2 * D  # v: value / reset-gate size
        self.span = span  # P: the relative bias covers offsets -(P-1)..P-1
        self.ema = DampedEMA(D, cfg.ndim)  # eq. 2-3, 6
        self.value = nn.Linear(D, self.hv)  # W_v, b_v (eq. 10)
        # [W_z | W_gamma | W_phi | W_h] and their biases, all applied to X' (eq. 7, 12-14)
        self.from_ema = nn.Linear(D, cfg.zdim + self.hv + 2 * D)
        self.out_gate = nn.Linear(self.hv, D)  # U_h (its bias is part of b_h; eq. 14)
        self.kappa = nn.Parameter(torch.empty(2, cfg.zdim))  # kappa_q, kappa_k (eq. 8-9)
        self.mu = nn.Parameter(torch.empty(2, cfg.zdim))  # mu_q, mu_k (eq. 8-9)
        self.rel_bias = nn.Parameter(torch.empty(2 * span - 1))  # w: b_rel[i,j] = w[P-1+j-i]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The official init (see the class docstring), from the global torch RNG."""
        self.ema.reset_parameters()
        with torch.no_grad():
            for lin in (self.value, self.from_ema, self.out_gate):
                lin.weight.normal_(0.0, 0.02)
                lin.bias.zero_()
            self.kappa.normal_(0.0, 0.02)
            self.mu.zero_()
            self.rel_bias.normal_(0.0, 0.02)  # drawn last: a chunked twin can share the rest

    def relative_bias(self, c: int) -> torch.Tensor:
        """b_rel [c, c]: entry (i, j) = w[P - 1 + j - i] (the official simple bias).

        Built from windows of w (a Toeplitz matrix): row r of ``unfold`` is w'[r : r + c] for
        w' = w[P - c : P + c - 1], the offsets -(c - 1)..c - 1; flipped, row i holds the
        offsets j - i. Unlike indexing w with a [c, c] tensor of offsets, autograd keeps no
        int64 [c, c] index (134 MB per layer for the whole-sequence form at n = 4096)."""
        w = self.rel_bias[self.span - c:self.span + c - 1]  # [2c-1]: offsets 1-c..c-1
        return w.unfold(0, c, 1).flip(0)  # [c,c]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               keep: torch.Tensor | None, ctx: AttnContext
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """O = f(Q K^T / tau + b_rel) V inside chunks (eq. 11).

        q, k [b, n, z], v [b, n, hv], keep [b, n] bool or None. Returns (O [b, n, hv],
        weights [b, nc, c, c] before dropout), c = min(chunk, n), nc = ceil(n / c); the
        sequence is padded to nc*c with keys that are masked.

        Memory: the chunks are views of q, k, v when c divides n (no padded copies), and the
        softmax form builds its scores in one ``baddbmm`` (bias included) masked in place,
        so autograd keeps only the weights and the views (at n = 4096, c = 128 these are
        [b, 32, 128, 128] buffers, each as large as a [b, n, 128] activation). A softmax row
        with no allowed key (a padded query in a chunk of padding only) is filled with the
        dtype's lowest finite value instead of -inf: it gets uniform weights instead of
        NaN; its output is zeroed by ``forward`` and its weights by ``_dense_map``.
        """
        b, n, _ = q.shape
        c = min(self.cfg.chunk or n, n)
        nc = -(-n // c)
        pad = nc * c - n

        def chunks(x: torch.Tensor) -> torch.Tensor:  # [b,n,e] -> [b*nc,c,e]
            if pad:
                x = F.pad(x, (0, 0, 0, pad))
            return x.reshape(b * nc, c, x.shape[-1])

        masked = keep is not None or pad > 0 or ctx.causal
        allowed = None  # [b,nc,1|c,c] bool: the keys each query of a chunk sees
        if masked:
            kept = torch.ones(b, n, dtype=torch.bool, device=q.device) if keep is None else keep
            allowed = F.pad(kept, (0, pad)).view(b, nc, 1, c)  # keys of each chunk
            if ctx.causal:
                allowed = allowed & torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        qc, kc = chunks(q), chunks(k)  # [b*nc,c,z]
        bias = self.relative_bias(c).to(q.dtype)  # [c,c]
        if self.cfg.attention_fn == "softmax":  # bias + Q K^T / sqrt(z), one GEMM
            scores = torch.baddbmm(bias, qc, kc.transpose(1, 2), alpha=self.cfg.zdim**-0.5)
            scores = scores.view(b, nc, c, c)
            if allowed is not None:
                scores.masked_fill_(~allowed, torch.finfo(scores.dtype).min)
            weights = torch.softmax(scores, dim=-1)  # [b,nc,c,c]
        else:  # laplace, tau = the number of keys the query sees (official normalisation)
            scores = torch.bmm(qc, kc.transpose(1, 2)).view(b, nc, c, c)  # Q K^T
            if allowed is None:
                weights = laplace(scores / c + bias)
            else:
                allowed = allowed.expand(b, nc, c, c)
                seen = allowed.sum(-1, keepdim=True).clamp(min=1).to(scores.dtype)  # [b,nc,c,1]
                weights = laplace(scores / seen + bias) * allowed
        p = weights
        if self.training and ctx.dropout > 0:
            p = F.dropout(weights, ctx.dropout, training=True)
        out = torch.bmm(p.view(b * nc, c, c), chunks(v))  # [b*nc,c,hv]
        return out.view(b, nc * c, -1)[:, :n], weights  # [b,n,hv]

    def _value_query_key(self, x: torch.Tensor, xe: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """V [b,n,hv], Q, K [b,n,z] from X and X' (eq. 7-10)."""
        zd = self.cfg.zdim
        value = _drop(F.silu(self.value(x)), self.cfg.hidden_dropout, self.training)  # V
        z = F.silu(F.linear(xe, self.from_ema.weight[:zd], self.from_ema.bias[:zd]))  # Z (eq. 7)
        kappa, mu = self.kappa.to(z.dtype), self.mu.to(z.dtype)
        return value, z * kappa[0] + mu[0], z * kappa[1] + mu[1]  # V, Q, K (eq. 8-9)

    def _gated_output(self, x: torch.Tensor, xe: torch.Tensor, o: torch.Tensor
                      ) -> torch.Tensor:
        """Y = phi * H + (1 - phi) * X [b,n,D] from X, X' and O (eq. 12-15)."""
        zd = self.cfg.zdim
        gate, upd, hx = F.linear(xe, self.from_ema.weight[zd:], self.from_ema.bias[zd:]).split(
            [self.hv, self.channels, self.channels], dim=-1)
        gate = F.silu(gate)  # gamma [b,n,hv] (eq. 12)
        upd = torch.sigmoid(upd)  # phi [b,n,D] (eq. 13)
        hid = F.silu(hx + self.out_gate(gate * o))  # H [b,n,D] (eq. 14)
        hid = _drop(hid, self.cfg.dropout, self.training)
        return torch.addcmul(x, upd, hid - x)  # (eq. 15)

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        b, h, n, d = v.shape
        require(q.shape[2] == n, f"mega runs its EMA over the tokens of the sequence "
                f"(keys_are_tokens): got {q.shape[2]} queries and {n} keys; use it for "
                "self-attention")
        require(d == self.dims.head_dim, f"mega was built for value head dim "
                f"{self.dims.head_dim} (HeadDims.head_dim) but v has {d}")
        require(self.cfg.chunk is not None or n <= self.span, f"mega without chunk was built "
                f"for at most {self.span} positions (HeadDims.max_len) but the input has {n}; "
                f"truncate the input or set chunk")
        keep = None
        if ctx.key_mask is not None:
            keep = ctx.key_mask.to(device=v.device, dtype=torch.bool).expand(b, n)  # [b,n]
        # X [b,n,D]: the heads merged, in the parameters' dtype (16-bit inputs reach a
        # float32 module called on its own); the output returns in v's dtype
        x = v.transpose(1, 2).reshape(b, n, h * d).to(self.value.weight.dtype)
        if keep is not None:
            x = x * keep[..., None].to(x.dtype)  # padded positions zeroed (official)
        xe = _drop(self.ema(x, keep, ctx.causal), self.cfg.dropout, self.training)  # X' (eq. 6)
        # the gates' activations are recomputed in the backward; the regions draw random
        # numbers only for the layer's own dropouts, and then the RNG state is stashed so
        # that the recomputation draws the same masks
        stash = self.training and (self.cfg.dropout > 0 or self.cfg.hidden_dropout > 0)
        if torch.is_grad_enabled():
            value, qz, kz = checkpoint(self._value_query_key, x, xe, use_reentrant=False,
                                       preserve_rng_state=stash)
        else:
            value, qz, kz = self._value_query_key(x, xe)
        o, weights = self.attend(qz, kz, value, keep, ctx)  # O [b,n,hv] (eq. 11)
        if torch.is_grad_enabled():
            y = checkpoint(self._gated_output, x, xe, o, use_reentrant=False,
                           preserve_rng_state=stash)
        else:
            y = self._gated_output(x, xe, o)  # Y [b,n,D]
        if keep is not None:
            y = y * keep[..., None].to(y.dtype)  # padded positions give 0
        out = y.view(b, n, h, d).transpose(1, 2).to(v.dtype)  # [b,h,n,d]
        probs = None
        if ctx.need_weights:
            probs = self._dense_map(weights, n, keep)[:, None].expand(b, h, n, n).to(v.dtype)
        return AttnOutput(out, probs)

    @staticmethod
    def _dense_map(weights: torch.Tensor, n: int, keep: torch.Tensor | None) -> torch.Tensor:
        """Chunk weights [b, nc, c, c] -> the block-diagonal map [b, n, n]; rows of padded
        positions 0."""
        b, nc, c, _ = weights.shape
        if nc == 1:
            dense = weights[:, 0, :n, :n]
        else:
            blocks = weights.new_zeros(b, nc, c, nc, c)  # [b,nc,c,nc,c]
            idx = torch.arange(nc, device=weights.device)
            blocks[:, idx, :, idx, :] = weights.transpose(0, 1)  # chunk u -> block (u, u)
            dense = blocks.view(b, nc * c, nc * c)[:, :n, :n]
        if keep is not None:
            dense = dense * keep[..., None].to(dense.dtype)
        return dense  # [b,n,n]
