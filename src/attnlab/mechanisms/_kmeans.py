"""Hamming-LSH codes of queries and k-means (Lloyd) in Hamming space, fully vectorised.

The clustering step of clustered attention: Vyas, Katharopoulos, Fleuret, "Fast
Transformers with Clustered Attention", NeurIPS 2020; official code idiap/fast-transformers
(``hashing/hash_cpu.cpp`` and ``clustering/hamming/cluster_cpu.cpp``), followed step by step:

  code:    bit_i(x) = 1[x . a_i > a_i0], B random hyperplanes (a_i, a_i0) ~ N(0, 1)
  init:    the codes of C distinct queries are the first centroids
  Lloyd:   T - 1 rounds of (assign each code to the nearest centroid in Hamming distance,
           ties to the lowest centroid index; centroid bit = majority vote of its members,
           a tie votes 0; a centroid left empty gets a fresh random code), then a final
           assignment.

Shape glossary: b batch, h heads, n queries, d head dim, B bits, C clusters, T iterations.
All random draws come in as a :class:`ClusterDraws` (seeded by the caller), shared by every
batch row and head, so a row's clustering never depends on the other rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ClusterDraws(NamedTuple):
    """The random draws of one clustering call (CPU, fp32/bool), shared by batch and heads.

    planes [B, d+1]: hyperplane normals a_i (first d columns) and offsets a_i0 (last).
    init_score [n]: the C real queries with the smallest score seed the centroids, in
      increasing score order (centroid c = the c-th smallest).
    empty_codes [max(T-1, 0), C, B] bool: the code a centroid gets when it is left empty
      in Lloyd round t.
    """

    planes: torch.Tensor
    init_score: torch.Tensor
    empty_codes: torch.Tensor


def draw_clustering(
    generator: torch.Generator, n: int, d: int, bits: int, clusters: int, iterations: int
) -> ClusterDraws:
    """Draw a :class:`ClusterDraws` for n queries of head dim d from ``generator``."""
    planes = torch.randn(bits, d + 1, generator=generator)  # [B, d+1]
    init_score = torch.rand(n, generator=generator)  # [n]
    rounds = max(iterations - 1, 0)
    empty = torch.rand(rounds, clusters, bits, generator=generator) < 0.5  # [T-1, C, B]
    return ClusterDraws(planes, init_score, empty)


def lsh_codes(q: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
    """Hamming-LSH codes [b, h, n, B] as 0./1. floats: bit_i = 1[q . a_i > a_i0].

    q [b, h, n, d] (no gradient is taken); planes [B, d+1] (the offset in the last column,
    the official ``hash_bias=True``: Hamming distance tracks the L2 distance).
    """
    planes = planes.to(device=q.device, dtype=q.dtype)
    proj = q.detach() @ planes[:, :-1].T  # [b,h,n,B]
    return (proj > planes[:, -1]).to(q.dtype)


def hamming(codes: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Hamming distances [b, h, n, C] between 0/1 codes [b,h,n,B] and centroids [b,h,C,B].

    |x xor c| = |x| + |c| - 2 x . c, one matmul; exact in fp32 (integers below 2^24).
    """
    cross = codes @ centroids.transpose(-1, -2)  # [b,h,n,C]
    return codes.sum(-1)[..., :, None] + centroids.sum(-1)[..., None, :] - 2 * cross


def identity_clusters(valid: torch.Tensor, clusters: int, h: int) -> torch.Tensor:
    """Every real query its own cluster: its rank among the real queries of its row.

    valid [b, n] bool (False = padded query) -> [b, h, n] long; padded queries get ``clusters``
    (no cluster). Only meaningful for rows with at most ``clusters`` real queries.
    """
    rank = valid.long().cumsum(-1) - 1  # [b,n]
    ids = torch.where(valid, rank, torch.full_like(rank, clusters))
    return ids[:, None, :].expand(-1, h, -1)


def hamming_kmeans(
    codes: torch.Tensor, valid: torch.Tensor, draws: ClusterDraws, clusters: int, iterations: int
) -> torch.Tensor:
    """Cluster ids [b, h, n] (long, in [0, C)) by T Lloyd iterations on codes [b,h,n,B].

    valid [b, n] bool: padded queries neither seed, vote nor count (their own id is
    meaningless; the caller overrides it). Needs C <= n.
    """
    b, h, n, nbits = codes.shape
    score = draws.init_score.to(codes.device)[None, :].expand(b, n)  # [b,n]
    score = score.masked_fill(~valid, float("inf"))  # padded queries never seed
    init = score.topk(clusters, dim=-1, largest=False, sorted=True).indices  # [b,C]
    cent = codes.gather(2, init[:, None, :, None].expand(b, h, clusters, nbits))  # [b,h,C,B]
    weight = valid[:, None, :].to(codes.dtype).expand(b, h, n)  # [b,h,n] votes of real queries
    signed = (2 * codes - 1) * weight[..., None]  # +1 / -1 per bit, 0 for padding [b,h,n,B]
    empty = draws.empty_codes.to(device=codes.device, dtype=codes.dtype)  # [T-1,C,B]
    for t in range(iterations - 1):
        assign = hamming(codes, cent).argmin(dim=-1)  # first nearest centroid [b,h,n]
        votes = codes.new_zeros(b, h, clusters, nbits).scatter_add_(
            2, assign[..., None].expand(-1, -1, -1, nbits), signed)  # (#1 - #0) [b,h,C,B]
        count = codes.new_zeros(b, h, clusters).scatter_add_(2, assign, weight)  # [b,h,C]
        cent = torch.where(count[..., None] > 0, (votes > 0).to(codes.dtype), empty[t])
    return hamming(codes, cent).argmin(dim=-1)  # [b,h,n]


def cluster_queries(
    q: torch.Tensor, draws: ClusterDraws, valid: torch.Tensor, clusters: int, iterations: int
) -> torch.Tensor:
    """Cluster id per query [b, h, n] (long): in [0, C) for real queries, C for padded ones.

    q [b, h, n, d]; valid [b, n] bool (False = padded query). A row with at most C real
    queries puts every real query in its own cluster (so C >= n is exactly softmax);
    the others run :func:`hamming_kmeans` on the LSH codes of q. No gradient.
    """
    b, h, n, _ = q.shape
    ident = identity_clusters(valid, clusters, h)  # [b,h,n]
    if clusters >= n:
        return ident
    codes = lsh_codes(q, draws.planes)  # [b,h,n,B]
    ids = hamming_kmeans(codes, valid, draws, clusters, iterations)  # [b,h,n]
    few = (valid.sum(-1) <= clusters)[:, None, None]  # [b,1,1] rows that need no clustering
    ids = torch.where(few, ident, ids)
    return ids.masked_fill(~valid[:, None, :], clusters)
