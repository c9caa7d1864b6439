"""Attention with learned priors (survey §3.5): a task-conditioned block-diagonal prior
(CA-MTL), the Average Attention Network, and Synthesizer attention.

Survey: Lin, Wang, Liu, Qiu, "A Survey of Transformers", AI Open 2022, §4.5 (attention with
prior). The residual-score prior (RealFormer) lives in ``priors.py``.

Shape glossary: b batch, h heads, n query length, m key length, d head dim, dv value dim,
L = HeadDims.max_len, T tasks, s CA-MTL block size, f hidden width of a per-head MLP.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..core import (
    AttnContext,
    AttnOutput,
    Capabilities,
    HeadDims,
    MechanismConfig,
    accumulation_dtype,
    check_qkv,
    register_mechanism,
    require,
)
from ..core.protocol import TASK_ID
from ._rowchunks import allowed_pairs, attend_rows, draws_dropout, in_row_chunks


def _init_linear_(weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int) -> None:
    """``nn.Linear``'s default init, per head: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        weight.uniform_(-bound, bound)
        if bias is not None:
            bias.uniform_(-bound, bound)


def _dropout(p: torch.Tensor, ctx: AttnContext, training: bool) -> torch.Tensor:
    return F.dropout(p, ctx.dropout, training=True) if training and ctx.dropout > 0 else p


def _check_length(name: str, length: int, max_len: int, what: str) -> None:
    require(length <= max_len,
            f"{name} got {length} {what} but its position tables cover max_len={max_len}; "
            f"build it with HeadDims.max_len >= {length} or truncate inputs to {max_len} tokens")


# ---------------------------------------------------------------------------- camtl_prior


@dataclass(frozen=True, kw_only=True)
class CamtlPriorConfig(MechanismConfig):
    name: ClassVar[str] = "camtl_prior"
    tasks: int = 2  # T: number of tasks; task ids are 0..T-1 (rows of the embedding z_i)
    blocks: int = 4  # N: diagonal blocks of M(z_i), each of s = ceil(L / N) positions
    task_dim: int = 32  # size of the task embedding z_i (official code: the hidden size)
    task: int | None = None  # fixed task id for batches that carry none (None: error)

    def __post_init__(self) -> None:
        require(self.tasks >= 1, f"camtl_prior tasks must be >= 1 (number of tasks), "
                f"got {self.tasks}")
        require(self.blocks >= 1, f"camtl_prior blocks must be >= 1 (diagonal blocks N), "
                f"got {self.blocks}")
        require(self.task_dim >= 1, f"camtl_prior task_dim must be >= 1, got {self.task_dim}")
        require(self.task is None or 0 <= self.task < self.tasks,
                f"camtl_prior task must be a task id in 0..{self.tasks - 1} (or None), "
                f"got {self.task}; raise tasks or pick an id below it")


@register_mechanism(CamtlPriorConfig)
class CamtlPrior(nn.Module):
    """Conditional attention: a task-conditioned block-diagonal prior added to the scores.

    Paper: Pilault, Elhattami, Pal, "Conditionally Adaptive Multi-Task Learning: Improving
    Transfer Learning in NLP Using Fewer Parameters & Less Data", ICLR 2021 (§2.2,
    "conditional attention"); official code github.com/CAMTL/CA-MTL
    (src/model/encoders/conditional_modules.py ``CBDA``, ca_mtl_base.py).
    Formula (z_i the embedding of task i, L = max_len, N = ``blocks``, s = ceil(L/N)):
        A in R^{L x s} stacks the N blocks A_n in R^{s x s} (rows n*s .. n*s+s-1)
        gamma(z_i), beta(z_i) = split(W z_i + c)  in R^s each         (FiLM)
        A'_n(z_i) = A_n (1 + gamma(z_i)) + beta(z_i)   (column-wise, as the official code)
        M(z_i) = blockdiag(A'_1, ..., A'_N)[:L, :L]  in R^{L x L}
        out = softmax(Q K^T / sqrt(d) + M(z_i) + mask) V
    i.e. M[p, r] = (1 + gamma[r mod s]) A[p, r mod s] + beta[r mod s] when p and r lie in the
    same block (p // s == r // s), else 0; for a sequence of n tokens M[:n, :n] is used.
    One M per example (its task), shared by the heads of this instance (as the official
    code: ``unsqueeze(1)`` over heads). Complexity O(n*m*d). Not ``exact`` in the caps'
    sense (the bias depends on the batch's task ids, not only on n, m): the tests compare
    it with a loop over the official block_diag construction.
    Init (official, where BERT's init_weights covers the modules): A = 0, the FiLM weight
    W ~ N(0, 0.02^2) and bias c = 0, task embeddings ~ N(0, 0.02^2): the prior starts near
    zero, so on a pretrained host the model starts as the host.
    Task id: ``ctx.extras["task_id"]`` (key ``core.protocol.TASK_ID``), an int or int tensor
    [b]; the Hugging Face backend fills it from :func:`attnlab.hf.set_task_id`. Without one
    the config's ``task`` is used; with neither it is an error. Multi-task adapter use: a
    plan of ``camtl_prior`` on a frozen encoder trains only these parameters.
    Deviations: the official code derives N = hidden / max_seq_length and shares one task
    embedding (plus a Linear "task transformation") across the encoder; here N is the
    ``blocks`` setting and each instance (layer, head group) owns its embedding table
    [T, task_dim] and FiLM layer (the Linear after an embedding adds no expressiveness).
    CA-MTL's other modules (conditional layer norm, adapters, alignment, MT-uncertainty
    sampling) are not part of this mechanism. Padding is masked (-inf) instead of the
    official additive -10000. ``need_weights`` returns the probabilities; ``ctx.dropout``
    applies to them in training. Without ``need_weights`` the rows run in chunks under
    activation checkpoints (``_rowchunks``): training keeps no [b, h, n, m] tensor.
    """

    example: ClassVar[str] = "camtl_prior(tasks=3, blocks=4, task_dim=8, task=1)"
    caps: ClassVar[Capabilities] = Capabilities(
        family="priors", paper="Pilault et al. 2021", needs_max_len=True, task_conditioned=True,
        keys_are_tokens=True, complexity="O(n*m)",
    )

    def __init__(self, cfg: CamtlPriorConfig, dims: HeadDims) -> None:
        super().__init__()
        require(dims.max_len is not None,
                "camtl_prior needs HeadDims.max_len: its blocks cover the positions 0..L-1")
        assert dims.max_len is not None
        require(cfg.blocks <= dims.max_len,
                f"camtl_prior blocks={cfg.blocks} exceeds max_len={dims.max_len}; use "
                f"blocks <= {dims.max_len}")
        self.cfg, self.dims = cfg, dims
        self.block = -(-dims.max_len // cfg.blocks)  # s = ceil(L / N)
        s = self.block
        self.task_embedding = nn.Parameter(torch.empty(cfg.tasks, cfg.task_dim))  # z: [T,e]
        self.film_weight = nn.Parameter(torch.empty(2 * s, cfg.task_dim))  # W: [2s,e]
        self.film_bias = nn.Parameter(torch.zeros(2 * s))  # c: [2s]
        self.blocks_a = nn.Parameter(torch.zeros(dims.max_len, s))  # A: [L,s]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The official init: A = 0, c = 0, W and z ~ N(0, 0.02^2) (global torch RNG)."""
        with torch.no_grad():
            self.task_embedding.normal_(0.0, 0.02)
            self.film_weight.normal_(0.0, 0.02)
            self.film_bias.zero_()
            self.blocks_a.zero_()

    def task_ids(self, ctx: AttnContext, b: int, device: torch.device) -> torch.Tensor:
        """[b] long task ids from ``ctx.extras["task_id"]`` or the config's ``task``."""
        raw = ctx.extras.get(TASK_ID, self.cfg.task)
        require(raw is not None,
                "camtl_prior needs a task id: call attnlab.hf.set_task_id(model, task_ids) "
                "before the forward, pass AttnContext(extras={'task_id': ids}), or fix one "
                "with camtl_prior(task=...)")
        ids = torch.as_tensor(raw, device=device)
        require(not ids.is_floating_point() and ids.dtype != torch.bool,
                f"camtl_prior task ids must be integers, got dtype {ids.dtype}")
        if ids.dim() == 0:
            ids = ids.expand(b)
        require(tuple(ids.shape) == (b,),
                f"camtl_prior task ids must be one int or one per example ([{b}]), got shape "
                f"{tuple(ids.shape)}")
        lo, hi = int(ids.min()), int(ids.max())
        require(0 <= lo and hi < self.cfg.tasks,
                f"camtl_prior task ids must lie in 0..{self.cfg.tasks - 1}, got {lo}..{hi}; "
                f"build it with tasks > {hi}")
        return ids.long()

    def prior(self, task_ids: torch.Tensor, n: int, m: int, first_row: int = 0
              ) -> torch.Tensor:
        """M(z)[:n, :m] for each example: task_ids [b] -> [b,n,m]; rows first_row ..
        first_row + n - 1 of M (a chunk of query rows) with ``first_row``."""
        s = self.block
        z = self.task_embedding[task_ids]  # [b,e]
        gamma, beta = (z @ self.film_weight.T + self.film_bias).chunk(2, dim=-1)  # [b,s] x2
        dev = z.device
        i = torch.arange(first_row, first_row + n, device=dev)
        j = torch.arange(m, device=dev)
        same = (i[:, None] // s) == (j[None, :] // s)  # [n,m] same diagonal block
        col = j % s  # [m] column inside the block
        a = self.blocks_a[first_row:first_row + n][:, col]  # [n,m] A[p, r mod s]
        film = (1 + gamma[:, None, col]) * a[None] + beta[:, None, col]  # [b,n,m]
        return film * same  # [b,n,m]

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        b, _, n, _ = q.shape
        m = k.shape[-2]
        require(n == m, f"camtl_prior indexes one sequence's positions (keys_are_tokens): "
                f"got {n} queries and {m} keys; use it for self-attention")
        assert self.dims.max_len is not None
        _check_length("camtl_prior", m, self.dims.max_len, "positions")
        ids = self.task_ids(ctx, b, q.device)
        if ctx.need_weights:
            out, probs = self._rows(q, k, v, ctx, ids, 0, n)
            return AttnOutput(out, probs)
        # the query rows in checkpointed chunks: training keeps no [b,h,n,m] (_rowchunks)
        out = in_row_chunks(lambda r0, qc: self._rows(qc, k, v, ctx, ids, r0, n)[0], q, m,
                            dropout=draws_dropout(ctx, self.training))
        return AttnOutput(out)

    def _rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext,
              ids: torch.Tensor, first_row: int, num_queries: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [b,h,c,dv], probabilities [b,h,c,m]) of query rows first_row .. of
        num_queries (q [b,h,c,d]: those rows; ids [b] the task ids)."""
        b, h, c, _ = q.shape
        m = k.shape[-2]
        scores = (q @ k.transpose(-1, -2)) * ctx.scale_for(q.shape[-1])  # [b,h,c,m]
        scores = scores + self.prior(ids, c, m, first_row).to(q.dtype)[:, None]  # + M
        return attend_rows(scores, v, ctx, self.training, first_row,
                           num_queries)  # [b,h,c,dv], [b,h,c,m]


# -------------------------------------------------------------------------------- average


@dataclass(frozen=True, kw_only=True)
class AverageConfig(MechanismConfig):
    name: ClassVar[str] = "average"
    ffn: bool = True  # FFN on the average, g = FFN(avg) (eq. 2); False: "w/o FFN" ablation
    hidden: int | None = None  # d_ff: FFN inner width per head (None = 4 d, as 2048 / 512)

    def __post_init__(self) -> None:
        require(self.hidden is None or self.hidden >= 1,
                f"average hidden must be >= 1 (FFN inner width) or None (4 * head_dim), "
                f"got {self.hidden}")


@register_mechanism(AverageConfig)
class Average(nn.Module):
    """Average attention: a (cumulative) average of the values, an FFN and a gate.

    Paper: Zhang, Xiong, Su, "Accelerating Neural Transformer via an Average Attention
    Network", ACL 2018 (§3, eqs. 1-3).
    Formula, per head (the paper's layer input y_j is the head's value v_j here):
        a_i = (1 / |K_i|) sum_{j in K_i} v_j       K_i: unpadded keys j, and j <= i if causal
        g_i = FFN(a_i) = max(0, a_i W1 + b1) W2 + b2                   (eq. 2)
        [i_i; f_i] = sigmoid([v_i; g_i] W_g + b_g)                     (eq. 3, the gate)
        out_i = i_i * v_i + f_i * g_i
    Causal: the paper's cumulative average (decoder). Bidirectional: the mean of all
    unpadded values (every row alike, so the FFN runs on one row per sequence). Fast path:
    cumulative sums, O(n*d); the paper's masked-matrix training form, W @ V with W[i, j] =
    1/|K_i| on K_i (O(n*m*d)), runs when the weights are needed or dropout is active.
    W_g is applied to v and to g apart (v W_g[:d] + g W_g[d:]), so no [n, 2d]
    concatenation is built or kept. Complexity O(n*d).
    Parameters per head, ``nn.Linear``'s init (global torch RNG): W1 [h,d,f], b1, W2
    [h,f,d], b2 (when ``ffn``), W_g [h,2d,2d], b_g.
    Head space (deviation): the paper averages and gates the layer input y; here each head
    averages and gates its values v (the per-head projection of y), so the output stays in
    the value space the host's output projection expects; the layer's residual connection
    and layer norm (eq. 4) are the host's. Neither q nor k is read (``caps.reads_qk``
    False: the host's Q/K projections get no gradient from these heads). Position i gates
    its own value v_i, so n == m (``keys_are_tokens``).
    ``need_weights`` returns the averaging weights W [b,h,n,m] (rows sum to 1 over K_i);
    out is not W @ V (the FFN and gate follow). ``ctx.dropout`` drops entries of W in
    training. Rows with no visible key give 0.
    """

    example: ClassVar[str] = "average(hidden=16)"
    caps: ClassVar[Capabilities] = Capabilities(
        family="priors", paper="Zhang et al. 2018", keys_are_tokens=True, reads_qk=False,
        complexity="O(n*d)",
    )

    def __init__(self, cfg: AverageConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims
        h, d = dims.num_heads, dims.head_dim
        f = cfg.hidden if cfg.hidden is not None else 4 * d
        self.ffn_w1 = nn.Parameter(torch.empty(h, d, f)) if cfg.ffn else None  # W1 [h,d,f]
        self.ffn_b1 = nn.Parameter(torch.empty(h, f)) if cfg.ffn else None  # b1 [h,f]
        self.ffn_w2 = nn.Parameter(torch.empty(h, f, d)) if cfg.ffn else None  # W2 [h,f,d]
        self.ffn_b2 = nn.Parameter(torch.empty(h, d)) if cfg.ffn else None  # b2 [h,d]
        self.gate_w = nn.Parameter(torch.empty(h, 2 * d, 2 * d))  # W_g [h,2d,2d]
        self.gate_b = nn.Parameter(torch.empty(h, 2 * d))  # b_g [h,2d]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default init per head (global torch RNG)."""
        d = self.dims.head_dim
        if self.ffn_w1 is not None:
            assert self.ffn_w2 is not None  # all four FFN tensors exist iff cfg.ffn
            _init_linear_(self.ffn_w1, self.ffn_b1, d)
            _init_linear_(self.ffn_w2, self.ffn_b2, self.ffn_w1.shape[-1])
        _init_linear_(self.gate_w, self.gate_b, 2 * d)

    def averaging_weights(self, ctx: AttnContext, b: int, n: int, device: torch.device,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [b,1,n,n] in ``dtype``: 1/|K_i| on the visible keys of row i, 0 elsewhere."""
        allowed = allowed_pairs(ctx, (b, 1, n, n), device).to(dtype)  # [b,1,n,n]
        return allowed / allowed.sum(-1, keepdim=True).clamp_min(1.0)

    @staticmethod
    def _average(v: torch.Tensor, ctx: AttnContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Fast path: (a [b,h,n|1,dv] in v's accumulation dtype, live [b,1,n|1,1]: row has
        a visible key)."""
        b, _, n, _ = v.shape
        work = accumulation_dtype(v.dtype)  # float32 for 16-bit values, else v's dtype
        keep = (torch.ones(b, n, device=v.device, dtype=work) if ctx.key_mask is None
                else ctx.key_mask.to(device=v.device, dtype=work))  # [b,n]
        vk = v.to(work) * keep[:, None, :, None]  # [b,h,n,dv] padded values zeroed
        if ctx.causal:
            sums, counts = vk.cumsum(2), keep.cumsum(-1)[:, None, :, None]  # prefix sums
        else:
            sums, counts = vk.sum(2, keepdim=True), keep.sum(-1)[:, None, None, None]
        return sums / counts.clamp_min(1.0), counts > 0

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        b, h, n, _ = q.shape
        d = self.dims.head_dim
        require(k.shape[-2] == n, f"average gates each position's own value with its average "
                f"(keys_are_tokens): got {n} queries and {k.shape[-2]} keys; use it for "
                f"self-attention")
        require(v.shape[-1] == d, f"average's FFN and gate are sized by head_dim={d}, but v "
                f"has head dim {v.shape[-1]}")
        weights = None
        if ctx.need_weights or (self.training and ctx.dropout > 0):
            work = accumulation_dtype(v.dtype)
            weights = self.averaging_weights(ctx, b, n, q.device, work)  # [b,1,n,n]
            live = weights.sum(-1, keepdim=True) > 0  # [b,1,n,1]
            avg = _dropout(weights, ctx, self.training) @ v.to(work)  # [b,h,n,dv]
        else:
            avg, live = self._average(v, ctx)  # [b,h,n|1,dv], [b,1,n|1,1]
        # g and the FFN on one row per sequence when every row's average is the same
        # (bidirectional fast path), broadcast over the rows only where they meet v
        g = avg.to(v.dtype)  # [b,h,n|1,d]
        # the parameters in v's dtype: 16-bit inputs reach a float32 module called on its
        # own (or under autocast), and the output keeps the input's dtype
        dt = v.dtype
        if self.ffn_w1 is not None:
            # all four FFN tensors exist iff cfg.ffn
            assert self.ffn_b1 is not None and self.ffn_w2 is not None
            assert self.ffn_b2 is not None
            hid = torch.relu(g @ self.ffn_w1.to(dt) + self.ffn_b1.to(dt)[:, None])  # [b,h,n|1,f]
            g = hid @ self.ffn_w2.to(dt) + self.ffn_b2.to(dt)[:, None]  # [b,h,n|1,d]
        # [v; g] W_g = v W_g[:d] + g W_g[d:] (eq. 3): no [b,h,n,2d] concatenation
        gate_w = self.gate_w.to(dt)  # W_g [h,2d,2d]
        g_part = g @ gate_w[:, d:] + self.gate_b.to(dt)[:, None]  # [b,h,n|1,2d]
        gates = torch.sigmoid(v @ gate_w[:, :d] + g_part)  # [b,h,n,2d]
        i_gate, f_gate = gates.chunk(2, dim=-1)  # [b,h,n,d] each
        out = (i_gate * v + f_gate * g) * live.expand(b, 1, n, 1).to(v.dtype)  # [b,h,n,d]
        probs = None
        if ctx.need_weights and weights is not None:
            probs = weights.expand(b, h, n, n).to(v.dtype)  # [b,h,n,m]
        return AttnOutput(out, probs)


# ---------------------------------------------------------------------------- synthesizer


@dataclass(frozen=True, kw_only=True)
class SynthesizerConfig(MechanismConfig):
    name: ClassVar[str] = "synthesizer"
    kind: Literal["dense", "random"] = "dense"  # synthesizing function: F(X_i) or table R
    factorized: bool = False  # dense: C = H_A(A) * H_B(B), a*b = L; random: R = R1 R2^T
    a: int = 8  # a: dense factorized, width of F_A's output (F_B's: b = L / a)
    rank: int = 8  # k: random factorized, rank of R = R1 R2^T with R1, R2 in R^{L x k}
    hidden: int | None = None  # dense: width of F's hidden layer (None = d, W1 in R^{d x d})
    trainable: bool = True  # random: learn R (False: the paper's "fixed random" variant)
    mix: float = 1.0  # alpha: weight of synthesized scores; 0 = dot-product only, 1 = none
    learn_mix: bool = False  # learn alpha per head (the paper's mixture weights), init mix

    def __post_init__(self) -> None:
        require(0.0 <= self.mix <= 1.0,
                f"synthesizer mix must lie in [0, 1] (0 = pure dot-product softmax, 1 = pure "
                f"synthesizer), got {self.mix}")
        require(self.a >= 1, f"synthesizer a must be >= 1 (F_A's width), got {self.a}")
        require(self.rank >= 1, f"synthesizer rank must be >= 1 (k of R1 R2^T), got {self.rank}")
        require(self.hidden is None or self.hidden >= 1,
                f"synthesizer hidden must be >= 1 or None (= head_dim), got {self.hidden}")
        require(self.trainable or self.kind == "random",
                "synthesizer trainable=False (a fixed table) applies to kind='random' only; "
                "drop it or use kind='random'")


@register_mechanism(SynthesizerConfig)
class Synthesizer(nn.Module):
    """Synthesized attention: scores from the query alone (dense) or a table (random).

    Paper: Tay, Bahri, Metzler, Juan, Zhao, Zheng, "Synthesizer: Rethinking Self-Attention
    for Transformer Models", ICML 2021 (§3); initialisations as the authors' LRA code
    (google-research/long-range-arena, models/synthesizer/synthesizer_attention.py).
    Formula, per head (L = max_len, X_i here the query q_i; S = the synthesized scores):
        dense:       S_i = F(q_i) = relu(q_i W1 + b1) W2 + b2 in R^L       (W1 [d,f], W2 [f,L])
        dense fact.: A = relu(q_i W1 + b1) W_A + b_A in R^a, B = ... W_B + b_B in R^b,
                     a*b = L; S_i = H_A(A) * H_B(B), (H_A(A))_r = A[r // b], (H_B(B))_r =
                     B[r mod b] (A's entries repeated b times, B tiled a times)
        random:      S = R in R^{L x L}, learned or fixed (``trainable``)
        random fact: S = R1 R2^T, R1, R2 in R^{L x k}
        mixture:     out = softmax((1 - alpha) Q K^T * scale + alpha S[:n, :m] + mask) V
    ``mix`` = alpha: 0 is plain dot-product softmax (tested equal), 1 (default) the pure
    synthesizer, which reads no k (and the random forms no q either: the host's
    projections get no gradient from those heads; ``caps.reads()`` of the instance says
    so). ``learn_mix`` makes alpha a per-head parameter initialised at ``mix`` (alpha_1 +
    alpha_2 = 1 kept by construction).
    Parameters are sized by L (caps.needs_max_len); an input of n <= L positions uses the
    first n rows / m columns; more is an error. Complexity O(n*m*f) (dense) / O(n*m).
    Init: dense MLPs as ``nn.Linear``; R ~ N(0, 1/L); R1 ~ N(0, 1/L), R2 ~ N(0, 1/k)
    (LRA's LeCun normal by fan-in; LRA truncates it and, as JAX does for 3-D kernels, also
    counts the head axis into the fan-in, std 1/sqrt(h L): here the std does not depend on
    how many heads a plan gives the instance). A fixed R is a persistent buffer (saved and
    reloaded, never trained).
    Deviations: head space — the paper's F reads the layer input X_i (d_model); here it
    reads the per-head query q_i, with one F per head. The paper's "tiling" H_A, H_B is
    read as above (repeat vs tile): tiling both the same way would give period lcm(a, b)
    < L, i.e. repeated columns. The factorized dense form shares F's hidden layer between
    its two heads F_A, F_B. Random forms need n == m (rows index query positions).
    ``need_weights`` returns the probabilities; ``ctx.dropout`` applies to them in training.
    Without ``need_weights`` the rows run in chunks under activation checkpoints
    (``_rowchunks``): training keeps no [b, h, n, m] tensor.
    """

    example: ClassVar[str] = "synthesizer(kind='dense', factorized=True, a=8, mix=0.5)"
    caps: ClassVar[Capabilities] = Capabilities(
        family="priors", paper="Tay et al. 2021", needs_max_len=True, keys_are_tokens=True,
        complexity="O(n*m)",
    )

    def __init__(self, cfg: SynthesizerConfig, dims: HeadDims) -> None:
        super().__init__()
        require(dims.max_len is not None,
                "synthesizer needs HeadDims.max_len: its scores have one column per position")
        assert dims.max_len is not None
        L, h, d = dims.max_len, dims.num_heads, dims.head_dim
        self.cfg, self.dims = cfg, dims
        if cfg.kind == "dense":
            f = cfg.hidden if cfg.hidden is not None else d
            self.w1 = nn.Parameter(torch.empty(h, d, f))  # W1 [h,d,f]
            self.b1 = nn.Parameter(torch.empty(h, f))  # b1 [h,f]
            widths = (cfg.a, L // cfg.a) if cfg.factorized else (L,)
            if cfg.factorized:
                require(L % cfg.a == 0,
                        f"synthesizer(factorized=True) needs a to divide max_len={L} "
                        f"(a*b = L); use a in {[x for x in range(1, L + 1) if L % x == 0]}")
            # dense: one head W2 [h,f,L]; factorized: W_A [h,f,a], W_B [h,f,b]
            self.heads_w = nn.ParameterList(nn.Parameter(torch.empty(h, f, w)) for w in widths)
            self.heads_b = nn.ParameterList(nn.Parameter(torch.empty(h, w)) for w in widths)
        else:
            shapes = ([(h, L, cfg.rank), (h, L, cfg.rank)] if cfg.factorized
                      else [(h, L, L)])  # R1, R2 [h,L,k] or R [h,L,L]
            tables = [torch.empty(s) for s in shapes]
            if cfg.trainable:
                self.tables = nn.ParameterList(nn.Parameter(t) for t in tables)
            else:
                for i, t in enumerate(tables):
                    self.register_buffer(f"table_{i}", t)
        self.alpha = nn.Parameter(torch.full((h,), cfg.mix)) if cfg.learn_mix else None
        if cfg.mix == 1.0 and not cfg.learn_mix:  # the pure synthesizer: no dot product
            read_q = cfg.kind == "dense"  # F(q_i); the random table reads neither
            vars(self)["caps"] = dataclasses.replace(type(self).caps, reads_qk=read_q,
                                                     reads_k=False)
        self.reset_parameters()

    def _tables(self) -> list[torch.Tensor]:
        if self.cfg.trainable:
            return list(self.tables)
        return [getattr(self, f"table_{i}") for i in range(2 if self.cfg.factorized else 1)]

    def reset_parameters(self) -> None:
        """nn.Linear's init for the MLPs; N(0, 1/fan_in) tables (global torch RNG)."""
        assert self.dims.max_len is not None
        if self.cfg.kind == "dense":
            _init_linear_(self.w1, self.b1, self.dims.head_dim)
            for w, bias in zip(self.heads_w, self.heads_b, strict=True):
                _init_linear_(w, bias, self.w1.shape[-1])
            return
        L = self.dims.max_len
        stds = [L**-0.5, self.cfg.rank**-0.5] if self.cfg.factorized else [L**-0.5]
        with torch.no_grad():
            for t, std in zip(self._tables(), stds, strict=True):
                t.normal_(0.0, std)

    def synthesized(self, q: torch.Tensor, m: int, first_row: int = 0) -> torch.Tensor:
        """S[:n, :m]: [b,h,n,m] (dense) or [1,h,n,m] (random), for q [b,h,n,d]; for a chunk
        of query rows, q holds rows first_row .. first_row + n - 1 (their rows of S)."""
        n = q.shape[-2]
        if self.cfg.kind == "dense":
            # in the parameters' dtype (float32 for 16-bit inputs to a float32 module, as the
            # random tables); the caller casts S to q's dtype
            q = q.to(self.w1.dtype)
            hid = torch.relu(q @ self.w1 + self.b1[:, None])  # [b,h,n,f]
            outs = [hid @ w + bias[:, None]
                    for w, bias in zip(self.heads_w, self.heads_b, strict=True)]
            if self.cfg.factorized:  # outer product flattened: S_r = A[r // b] * B[r % b]
                s = (outs[0][..., :, None] * outs[1][..., None, :]).flatten(-2)  # [b,h,n,L]
            else:
                s = outs[0]  # [b,h,n,L]
            return s[..., :m]  # [b,h,n,m]
        tables = self._tables()
        rows = slice(first_row, first_row + n)
        if self.cfg.factorized:
            return (tables[0][:, rows] @ tables[1][:, :m].transpose(-1, -2))[None]  # [1,h,n,m]
        return tables[0][None, :, rows, :m]  # [1,h,n,m]

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v, self.dims)
        b, h, n, _ = q.shape
        m = k.shape[-2]
        assert self.dims.max_len is not None
        _check_length("synthesizer", m, self.dims.max_len, "keys")
        if self.cfg.kind == "random":
            require(n == m, f"synthesizer(kind='random') indexes one sequence's positions: "
                    f"got {n} queries and {m} keys; use it for self-attention")
        if ctx.need_weights:
            out, probs = self._rows(q, k, v, ctx, 0, n)
            return AttnOutput(out, probs)
        # the query rows in checkpointed chunks: training keeps no [b,h,n,m] (_rowchunks)
        out = in_row_chunks(lambda r0, qc: self._rows(qc, k, v, ctx, r0, n)[0], q, m,
                            dropout=draws_dropout(ctx, self.training))
        return AttnOutput(out)

    def _rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext,
              first_row: int, num_queries: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [b,h,c,dv], probabilities [b,h,c,m]) of query rows first_row .. of
        num_queries (q [b,h,c,d]: those rows)."""
        b, h, c, _ = q.shape
        m = k.shape[-2]
        alpha = (self.alpha.to(q.dtype)[None, :, None, None] if self.alpha is not None
                 else self.cfg.mix)  # [1,h,1,1] or a float
        scores = alpha * self.synthesized(q, m, first_row).to(q.dtype)  # [b|1,h,c,m]
        if self.alpha is not None or self.cfg.mix < 1.0:
            dot = (q @ k.transpose(-1, -2)) * ctx.scale_for(q.shape[-1])  # [b,h,c,m]
            scores = (1 - alpha) * dot + scores
        return attend_rows(scores.expand(b, h, c, m), v, ctx, self.training, first_row,
                           num_queries)  # [b,h,c,dv], [b,h,c,m]
