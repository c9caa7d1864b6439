"""How much attention heads share the output space: subspace overlap of their W_O blocks.

Head i writes into the residual stream through its block of the output projection,
W_O^i = W_O[:, i*dv:(i+1)*dv] ([D, dv], D the model width), so its contribution always lies in
the column space col(W_O^i), of dimension r_i = rank(W_O^i) <= dv. Two heads compete for the
directions their subspaces share. With U_i [D, r_i] an orthonormal basis of col(W_O^i), the
cosines of the k = min(r_i, r_j) principal angles between the subspaces are the singular
values of U_i^T U_j, and the overlap of heads i and j is their mean squared cosine:

    overlap(i, j) = (1/k) sum_l cos^2(theta_l) = ||U_i^T U_j||_F^2 / k        in [0, 1]

0: orthogonal subspaces (the heads write to disjoint directions); 1: one subspace contains
the other (the same subspace when r_i = r_j). It depends on the subspaces only, so it is
unchanged by a change of basis inside a head (W_O^i M for any invertible M [dv, dv]) and by
a rotation of the output space. Chance level, two random dv-dimensional subspaces of R^D:
dv / D (MiniLM: 32 / 384 = 0.083). A head with an all-zero block (rank 0) shares nothing:
its overlaps are 0. A layer's overlap is the mean over its h (h - 1) / 2 pairs.

Bases come from the SVD of each block (left singular vectors whose singular value exceeds
``max(D, dv) * eps * s_max``, the matrix-rank tolerance of the weight's dtype), computed in
float64. Cost per layer: h SVDs of [D, dv] and h^2 / 2 products [r, D] x [D, r].
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def head_bases(weight: torch.Tensor, num_heads: int) -> list[torch.Tensor]:
    """Orthonormal bases U_i [D, r_i] of the column spaces of the h blocks of ``weight``.

    weight: W_O [D, h*dv] (``nn.Linear(h*dv, D).weight``).
    """
    if weight.dim() != 2 or weight.shape[1] % num_heads:
        raise ValueError(f"W_O of shape {tuple(weight.shape)} does not split into {num_heads} "
                         "heads; pass the output projection's weight [D, h*dv]")
    eps = torch.finfo(weight.dtype).eps if weight.is_floating_point() else 1e-7
    w = weight.detach().to(torch.float64)
    dv = w.shape[1] // num_heads
    bases = []
    for i in range(num_heads):
        block = w[:, i * dv:(i + 1) * dv]  # [D, dv]
        u, s, _ = torch.linalg.svd(block, full_matrices=False)  # u [D, dv], s [dv]
        tol = max(block.shape) * eps * (s[0] if s.numel() else 0.0)
        bases.append(u[:, s > tol] if s.numel() and s[0] > 0 else u[:, :0])
    return bases


def subspace_overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean squared cosine of the principal angles between col(a) and col(b) (orthonormal
    bases [D, r_a], [D, r_b]); 0 when either is empty."""
    k = min(a.shape[1], b.shape[1])
    if k == 0:
        return 0.0
    return float((a.T @ b).pow(2).sum() / k)


def pairwise_overlap(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """overlap(i, j) for every pair of heads of one layer: [h, h] float64, symmetric, with
    1 on the diagonal for heads of rank > 0."""
    bases = head_bases(weight, num_heads)
    out = torch.zeros(num_heads, num_heads, dtype=torch.float64)
    for i in range(num_heads):
        for j in range(i, num_heads):
            out[i, j] = out[j, i] = subspace_overlap(bases[i], bases[j])
    return out


def layer_overlap(weight: torch.Tensor, num_heads: int) -> float:
    """Mean overlap over the h (h - 1) / 2 pairs of distinct heads of one layer."""
    if num_heads < 2:
        raise ValueError("overlap between heads needs at least 2 heads")
    pairs = pairwise_overlap(weight, num_heads)
    iu = torch.triu_indices(num_heads, num_heads, offset=1)
    return float(pairs[iu[0], iu[1]].mean())


def model_overlap(model: nn.Module) -> dict[str, Any]:
    """Per-layer W_O overlap of a Hugging Face encoder (any family ``attnlab.hf.arch``
    knows): ``{"per_layer": [float, ...], "mean": float, "chance": dv / D}``."""
    from ..hf.arch import inspect_model, output_projections

    host = inspect_model(model)
    projections = [lin for _, lin in output_projections(model, host)]
    per_layer = [layer_overlap(lin.weight, host.num_heads) for lin in projections]
    dv = projections[0].in_features // host.num_heads
    return {"per_layer": per_layer, "mean": sum(per_layer) / len(per_layer),
            "chance": dv / projections[0].out_features}


def format_overlap(before: dict[str, Any], after: dict[str, Any] | None = None) -> str:
    """A small table: one column per layer, rows ``before`` (and ``after``)."""
    n = len(before["per_layer"])
    lines = [f"W_O subspace overlap between heads (mean cos^2 of principal angles; chance "
             f"{before['chance']:.3f})",
             "layer   " + " ".join(f"{i:>6d}" for i in range(n)) + "    mean"]
    rows = [("before", before)] + ([("after", after)] if after is not None else [])
    for label, rec in rows:
        lines.append(f"{label:<8}" + " ".join(f"{v:6.3f}" for v in rec["per_layer"])
                     + f"  {rec['mean']:6.3f}")
    return "\n".join(lines)
