"""Linearised attention: a positive feature map replaces the softmax kernel, O(n) in length."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..core import (
    AttnContext,
    AttnOutput,
    Capabilities,
    HeadDims,
    MechanismConfig,
    causal_mask,
    check_qkv,
    register_mechanism,
)


@dataclass(frozen=True, kw_only=True)
class LinearEluConfig(MechanismConfig):
    name: ClassVar[str] = "linear_elu"
    eps: float = 1e-6  # epsilon: added to the normaliser phi(q_i)^T sum_j phi(k_j)
    chunk: int = 64  # C: chunk length of the causal prefix sums (implementation, not paper)

    def __post_init__(self) -> None:
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0 (it keeps empty rows finite), got {self.eps}")
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1: positive, so every normaliser is a sum of positive terms."""
    return F.elu(x) + 1.0


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Sums over the whole sequence lose too much in 16-bit floats; accumulate in fp32.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _features(
    q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """phi(q) [b,h,n,d], phi(k) [b,h,m,d] with padded keys zeroed (so they are invisible)."""
    fq, fk = elu_feature_map(q), elu_feature_map(k)
    if key_mask is not None:
        fk = fk * key_mask[:, None, :, None].to(fk.dtype)  # [b,h,m,d]
    return fq, fk


def _bidirectional(fq, fk, v, eps: float) -> torch.Tensor:
    """out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps)."""
    kv = torch.einsum("bhmd,bhme->bhde", fk, v)  # [b,h,d,dv]
    z = fk.sum(dim=-2)  # [b,h,d]
    num = torch.einsum("bhnd,bhde->bhne", fq, kv)  # [b,h,n,dv]
    den = torch.einsum("bhnd,bhd->bhn", fq, z)  # [b,h,n]
    return num / (den.unsqueeze(-1) + eps)


def _causal(fq, fk, v, eps: float, chunk: int) -> torch.Tensor:
    """Causal form with chunked prefix sums; queries aligned to the last n keys.

    Query i sees keys j <= i + (m - n). Keys before the aligned block seed the running
    state; queries before it (n > m) see nothing and give zeros. Inside the aligned block
    the state S = sum phi(k_j) v_j^T [b,h,d,dv] and z = sum phi(k_j) [b,h,d] are carried
    across chunks of C positions, and each chunk adds its own lower-triangular C x C part,
    so memory is O(b*h*(C^2 + d*dv)) instead of the O(b*h*n*d*dv) of a full cumsum.
    """
    b, h, n, _ = fq.shape
    m = fk.shape[-2]
    offset = m - n
    if offset >= 0:
        state = torch.einsum("bhmd,bhme->bhde", fk[:, :, :offset], v[:, :, :offset])
        z = fk[:, :, :offset].sum(dim=-2)  # [b,h,d]
        q0, fk, v = 0, fk[:, :, offset:], v[:, :, offset:]
    else:
        state = fq.new_zeros(b, h, fq.shape[-1], v.shape[-1])  # [b,h,d,dv]
        z = fq.new_zeros(b, h, fq.shape[-1])  # [b,h,d]
        q0 = -offset  # queries [0, q0) have no visible key: their rows stay zero
    length = n - q0  # aligned queries == aligned keys
    pieces = [fq.new_zeros(b, h, q0, v.shape[-1])]  # [b,h,q0,dv]
    for s in range(0, length, chunk):
        e = min(s + chunk, length)
        qc = fq[:, :, q0 + s : q0 + e]  # [b,h,C,d]
        kc, vc = fk[:, :, s:e], v[:, :, s:e]  # [b,h,C,d], [b,h,C,dv]
        tri = torch.ones(e - s, e - s, dtype=torch.bool, device=fq.device).tril()
        a = (qc @ kc.transpose(-1, -2)).masked_fill(~tri, 0.0)  # [b,h,C,C]
        num = a @ vc + qc @ state  # [b,h,C,dv]
        den = a.sum(dim=-1) + torch.einsum("bhcd,bhd->bhc", qc, z)  # [b,h,C]
        pieces.append(num / (den.unsqueeze(-1) + eps))
        state = state + kc.transpose(-1, -2) @ vc  # [b,h,d,dv]
        z = z + kc.sum(dim=-2)
    return torch.cat(pieces, dim=2)  # [b,h,n,dv]


def linear_weights(fq, fk, causal: bool, eps: float) -> torch.Tensor:
    """The normalised phi(q) phi(k)^T matrix [b,h,n,m] (what the O(n) path implicitly uses)."""
    a = fq @ fk.transpose(-1, -2)  # [b,h,n,m]
    if causal:
        a = a.masked_fill(~causal_mask(a.shape[-2], a.shape[-1], a.device), 0.0)
    return a / (a.sum(dim=-1, keepdim=True) + eps)


@register_mechanism(LinearEluConfig)
class LinearElu(nn.Module):
    """Linear attention with the elu(x) + 1 feature map.

    Paper: Katharopoulos, Vyas, Pappas, Fleuret, "Transformers are RNNs: Fast
    Autoregressive Transformers with Linear Attention", ICML 2020.
    Formula: phi(x) = elu(x) + 1;
    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps),
    with the sums over j <= i (prefix sums) when causal.
    Complexity O(n*d^2) time, O(d^2) state per head (causal: chunked prefix sums, O(C^2)
    extra per chunk of C positions).
    Padding: padded keys are zeroed in phi(k), so they add nothing to either sum; a row
    with no visible key has numerator 0 and gives 0 (eps keeps the division finite).
    Deviations / notes: as in the paper and its fast-transformers code, the feature map
    takes the raw q, k (``ctx.scale`` is not used: the kernel has no temperature) and
    there is no attention dropout (no probability matrix exists on the O(n) path;
    ``ctx.dropout`` is ignored). 16-bit inputs are accumulated in fp32.
    ``need_weights`` materialises the normalised phi(q) phi(k)^T matrix, O(n*m).
    """

    caps: ClassVar[Capabilities] = Capabilities(
        family="linear", paper="Katharopoulos et al. 2020", exact=False,
        complexity="O(n*d^2)",
    )

    def __init__(self, cfg: LinearEluConfig, dims: HeadDims) -> None:
        super().__init__()
        self.cfg, self.dims = cfg, dims

    def forward(self, q, k, v, ctx: AttnContext) -> AttnOutput:
        check_qkv(q, k, v)
        dtype = q.dtype
        work = _compute_dtype(dtype)
        fq, fk = _features(q.to(work), k.to(work), ctx.key_mask)  # [b,h,n,d], [b,h,m,d]
        vw = v.to(work)  # [b,h,m,dv]
        if ctx.causal:
            out = _causal(fq, fk, vw, self.cfg.eps, self.cfg.chunk)
        else:
            out = _bidirectional(fq, fk, vw, self.cfg.eps)
        probs = None
        if ctx.need_weights:
            probs = linear_weights(fq, fk, ctx.causal, self.cfg.eps).to(dtype)
        return AttnOutput(out.to(dtype), probs)
