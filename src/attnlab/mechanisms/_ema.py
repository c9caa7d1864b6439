"""Multi-dimensional damped exponential moving average: MEGA's EMA sub-layer.

Paper: Ma, Zhou, Kong, He, Gui, Neubig, May, Zettlemoyer, "Mega: Moving Average Equipped
Gated Attention", ICLR 2023, §3.1 (eq. 2-3); official code: ``MultiHeadEMA`` in
facebookresearch/mega, ``fairseq/modules/exponential_moving_average.py``.

Per channel c of x [b, n, D] and EMA dimension r = 1..N (N = ``ndim``, the paper's h), eq. 2-3:

    u_t = beta x_t                                     (expansion to N dimensions)
    h_t = alpha * u_t + (1 - alpha * delta) * h_{t-1}  (damped EMA; alpha, delta in (0, 1))
    y_t = s * eta^T h_t                                (projection back; s = 1/sqrt(N))

with alpha = sigmoid(alpha_raw), delta = sigmoid(delta_raw) (the official code names them
``delta`` and ``alpha`` the other way round; the parametrisation is the same). Unrolled,
y = k * x is a causal convolution with the kernel

    k_l = s * sum_r eta_r alpha_r beta_r q_r^l,  q_r = 1 - alpha_r delta_r,  l = 0..n-1,

computed here with one real FFT of length 2n (zero padding, so no wrap-around), O(n log n)
per channel: in float32 as official (the causal convolution in float64, see
:meth:`DampedEMA.convolve`), everything in float64 for float64 inputs (:func:`precision`).
Bidirectional (as official): a second, independent set of parameters gives a backward
kernel k' that runs from the future, y_t = sum_{j<=t} k_{t-j} x_j + sum_{j>=t} k'_{j-t} x_j;
both share one FFT of x (the backward term is a correlation: the conjugate spectrum of k').
The sub-layer's output adds the official residual omega * x and the SiLU:
X' = silu(y + omega * x).

Decoding (causal): :meth:`DampedEMA.step` advances the recurrence one token at a time with
the state h [b, D, N]; :meth:`DampedEMA.final_state` gives the state after a prefix, so a
prompt can be encoded with the FFT and continued step by step.
Shapes: b batch, n length, D channels, N EMA dimensions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

FORWARD, BACKWARD = 0, 1  # index of a direction in the parameters' first axis


def precision(dtype: torch.dtype) -> torch.dtype:
    """The EMA's working precision for inputs of ``dtype``: float64 for float64 (a float64
    input is computed in float64), else the official float32 (half inputs included)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class DampedEMA(nn.Module):
    """MEGA's multi-dimensional damped EMA over D channels (see the module docstring).

    Parameters [2, D, N] (direction: forward, backward; channel; EMA dimension):
    ``alpha_raw``, ``delta_raw`` (through sigmoid), ``beta``, ``eta``; ``omega`` [D].
    Init as official: alpha_raw, delta_raw ~ N(0, 0.2); beta ~ N(0, 0.02) + (1, -1, 1, ...)
    along the EMA dimension; eta, omega ~ N(0, 1); all from the global torch RNG.
    The backward parameters are used only by the bidirectional form.
    """

    def __init__(self, channels: int, ndim: int) -> None:
        super().__init__()
        if channels < 1 or ndim < 1:
            raise ValueError(f"DampedEMA needs channels >= 1 and ndim >= 1, got {channels}, "
                             f"{ndim}")
        self.channels, self.ndim = channels, ndim
        self.scale = ndim**-0.5  # s: keeps eta^T h at the scale of one dimension
        self.alpha_raw = nn.Parameter(torch.empty(2, channels, ndim))  # alpha before sigmoid
        self.delta_raw = nn.Parameter(torch.empty(2, channels, ndim))  # delta before sigmoid
        self.beta = nn.Parameter(torch.empty(2, channels, ndim))  # beta: expansion
        self.eta = nn.Parameter(torch.empty(2, channels, ndim))  # eta: projection
        self.omega = nn.Parameter(torch.empty(channels))  # omega: residual weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The official init (see the class docstring), from the global torch RNG."""
        with torch.no_grad():
            self.alpha_raw.normal_(0.0, 0.2)
            self.delta_raw.normal_(0.0, 0.2)
            sign = torch.ones(self.ndim)
            sign[1::2] = -1.0  # (1, -1, 1, -1, ...): the official, "more stable" start
            self.beta.normal_(0.0, 0.02).add_(sign)
            self.eta.normal_(0.0, 1.0)
            self.omega.normal_(0.0, 1.0)

    def coefficients(self, dtype: torch.dtype = torch.float32
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(alpha * beta, q = 1 - alpha * delta), each [2, D, N] in ``dtype`` (float32, or
        float64 for float64 inputs: :func:`precision`): the input weight and the decay of the
        recurrence h_t = (alpha beta) x_t + q h_{t-1} (eq. 2-3)."""
        alpha = torch.sigmoid(self.alpha_raw.to(dtype))
        q = 1.0 - alpha * torch.sigmoid(self.delta_raw.to(dtype))
        return alpha * self.beta.to(dtype), q

    def powers(self, n: int, dtype: torch.dtype = torch.float32
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """q^l for l < n in two factors, l = a*B + i with B = ceil(sqrt(n)), A = ceil(n/B):
        (q^i [2, D, N, B], q^(aB) [2, D, N, A]) in ``dtype``. O(D*N*sqrt(n)) exponentials
        instead of the Vandermonde matrix's O(D*N*n) (which made the kernel the layer's hot
        spot on CPU at n = 4096)."""
        _, q = self.coefficients(dtype)
        log_q = torch.log(q)[..., None]  # [2,D,N,1]
        B = math.isqrt(max(n - 1, 0)) + 1  # B*B >= n
        A = -(-n // B)
        steps = torch.arange(max(A, B), device=q.device, dtype=dtype)
        return torch.exp(log_q * steps[:B]), torch.exp(log_q * (steps[:A] * B))

    def kernel(self, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """k [2, D, n] in ``dtype``: k_l = s * sum_r eta_r alpha_r beta_r q_r^l, per
        direction; with q^l = q^(aB) q^i (:meth:`powers`) the sum over r is one batched
        matmul [A, N] @ [N, B] per channel and direction."""
        ab, _ = self.coefficients(dtype)
        inner, outer = self.powers(n, dtype)  # [2,D,N,B], [2,D,N,A]
        outer = outer * (ab * self.eta.to(dtype) * self.scale)[..., None]  # weighted [2,D,N,A]
        k = outer.transpose(-1, -2) @ inner  # [2,D,A,B]: entry (a, i) is lag a*B + i
        return k.flatten(-2)[..., :n]  # [2,D,n]

    def convolve(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        """y = k * x (and + the backward term unless causal) via one FFT of length 2n.
        x [b, n, D] -> y [b, n, D] in x's dtype; the kernel in :func:`precision` (float32,
        float64 for float64 x), the convolution in that (bidirectional) or float64 (causal).

        The FFT mixes every position's rounding error into every output: in float32 an
        output would move by ~1e-7 of the inputs' magnitude when a *future* input changes.
        The causal form therefore runs in float64, where that is below float32 resolution;
        the bidirectional form, which reads the future anyway, keeps the official float32.
        """
        n = x.shape[1]
        prec = precision(x.dtype)
        work = torch.float64 if causal else prec
        k = self.kernel(n, prec).to(work)  # [2,D,n]
        y = _FFTConv.apply(x.to(work).transpose(1, 2), k[FORWARD],
                           None if causal else k[BACKWARD])  # [b,D,n]
        return y.transpose(1, 2).to(x.dtype)  # [b,n,D]

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None,
                causal: bool = False) -> torch.Tensor:
        """X' = silu(EMA(x) + omega * x). x [b, n, D]; keep [b, n] bool (True = token):
        padded positions are zeroed first, so they never reach a token. -> [b, n, D]."""
        if keep is not None:
            x = x * keep[..., None].to(x.dtype)  # padding zeroed before the EMA (official)
        y = self.convolve(x, causal)  # [b,n,D]
        return F.silu(y + x * self.omega)

    def step(self, x: torch.Tensor, state: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One causal token: x [b, D], state h_{t-1} [b, D, N] (None = zeros) ->
        (X'_t [b, D] in x's dtype, h_t [b, D, N] in :func:`precision`). The recurrence of
        eq. 2-3, forward parameters."""
        prec = precision(x.dtype)
        ab, q = (c[FORWARD] for c in self.coefficients(prec))  # [D,N]
        xp = x.to(prec)
        h = ab * xp[..., None]  # alpha beta x_t [b,D,N]
        if state is not None:
            h = h + q * state.to(prec)
        y = torch.einsum("bcr,cr->bc", h, self.eta[FORWARD].to(prec) * self.scale)
        return F.silu(y + xp * self.omega.to(prec)).to(x.dtype), h

    def final_state(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The causal recurrence's state after the last token of x [b, n, D]:
        h_n = sum_j q^(n-1-j) alpha beta x_j [b, D, N] in :func:`precision` (what
        :meth:`step` continues from). Lag l = n-1-j = a*B + i: the sum over i, then over a
        (:meth:`powers`)."""
        if keep is not None:
            x = x * keep[..., None].to(x.dtype)
        b, n, ch = x.shape
        prec = precision(x.dtype)
        ab, _ = self.coefficients(prec)
        inner, outer = (t[FORWARD] for t in self.powers(n, prec))  # [D,N,B], [D,N,A]
        B, A = inner.shape[-1], outer.shape[-1]
        lagged = F.pad(x.to(prec).flip(1), (0, 0, 0, A * B - n))  # row l: x_{n-1-l}
        part = torch.einsum("baic,cri->bacr", lagged.view(b, A, B, ch), inner)  # [b,A,D,N]
        return torch.einsum("bacr,cra->bcr", part, outer) * ab[FORWARD]  # [b,D,N]

    def extra_repr(self) -> str:
        return f"channels={self.channels}, ndim={self.ndim}"


class _FFTConv(torch.autograd.Function):
    """y = k * x (+ the correlation with k' when given) over the last axis, via one real FFT
    of length 2n, with a hand-written backward that saves x and the kernels' spectrum
    instead of x's spectrum: autograd through ``rfft -> mul -> irfft`` keeps the complex
    [b, D, n+1] spectrum of x (twice x's size); here it is recomputed (one more FFT).

    x [b, D, n], k [D, n] (lags 0..n-1, forward: y_t += k_l x_{t-l}), kb [D, n] or None
    (backward: y_t += kb_l x_{t+l}). With zero padding to 2n the circular convolution by
    h = irfft(K), K = rfft(k) + conj(rfft(kb)), is the linear one. Backward, with G the
    spectrum of dy: dx = irfft(G conj(K)) (the adjoint: correlation with h) and
    dh = irfft(sum_b G conj(X)), of which dk_l = dh_l and dkb_l = dh_(-l mod 2n).
    """

    @staticmethod
    def forward(ctx, x, k, kb):
        n = x.shape[-1]
        size = 2 * n  # zero padding to 2n: the circular convolution is the linear one
        k_f = torch.fft.rfft(k, n=size)  # [D,n+1]
        if kb is not None:  # correlation with the backward kernel: conjugate spectrum
            k_f = k_f + torch.fft.rfft(kb, n=size).conj()
        y = torch.fft.irfft(torch.fft.rfft(x, n=size) * k_f, n=size)[..., :n]  # [b,D,n]
        ctx.save_for_backward(x, k_f)
        ctx.bidirectional = kb is not None
        return y

    @staticmethod
    def backward(ctx, gy):
        x, k_f = ctx.saved_tensors
        n = x.shape[-1]
        size = 2 * n
        g_f = torch.fft.rfft(gy, n=size)  # [b,D,n+1]
        dx = dk = dkb = None
        if ctx.needs_input_grad[0]:
            dx = torch.fft.irfft(g_f * k_f.conj(), n=size)[..., :n]
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            cross = (g_f * torch.fft.rfft(x, n=size).conj()).sum(0)  # [D,n+1]
            dh = torch.fft.irfft(cross, n=size)  # [D,2n]: lags 0..2n-1 (mod 2n)
            dk = dh[..., :n]
            if ctx.bidirectional:  # lag -l: index 0, then 2n-1 down to n+1
                dkb = torch.cat([dh[..., :1], dh[..., n + 1:].flip(-1)], -1)
        return dx, dk, dkb
