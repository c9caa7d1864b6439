"""Float64 references for the linearised, low-rank and landmark mechanisms, written from the
papers' equations independently of the implementations (issues 21 §3.2 and 22 §3.4).

Each reference loops where the paper states a sum (the linear-attention RNN), pads where the
paper pads (Linformer's E, F act on N rows), takes features without any stabiliser (FAVOR+),
and inverts explicitly (CSALR). Inputs are float64 and the outputs must stay float64 and
agree to 1e-10, over unequal lengths, n = 1, fewer tokens than landmarks / projected rows,
and a right-padded batch row.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import attnlab
from attnlab import AttnContext, HeadDims

D64 = torch.float64
H, HD = 3, 8


def build(spec: str, max_len: int | None = None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # k >= max_len, rank >= head_dim: warned, allowed
        mech = attnlab.build_mechanism(spec, HeadDims(H, HD, max_len))
    return mech.double().eval()


def qkv(n: int, m: int | None = None, seed: int = 0, b: int = 2):
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    return (torch.randn(b, H, n, HD, generator=g, dtype=D64),
            torch.randn(b, H, m, HD, generator=g, dtype=D64),
            torch.randn(b, H, m, HD, generator=g, dtype=D64))


def right_padded(m: int) -> torch.Tensor:
    """[2, m]: row 0 unpadded, row 1 keeps its first m - max(1, m // 3) keys."""
    keep = torch.ones(2, m, dtype=torch.bool)
    keep[1, m - max(1, m // 3):] = False
    return keep


def run(mech, q, k, v, **ctx) -> torch.Tensor:
    out = mech(q, k, v, AttnContext(**ctx)).out
    assert out.dtype == D64
    return out


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-10) -> None:
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def dense_softmax(q, k, v, scale, allowed):
    """softmax over ``allowed`` [b|1, h|1, n, m]; rows with no allowed key give 0."""
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, -math.inf)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def visible(n: int, m: int, keep, causal: bool) -> torch.Tensor:
    """[b|1, 1, n, m]: key j visible to query i (causal: j <= i + m - n)."""
    ok = torch.ones(1, 1, n, m, dtype=torch.bool)
    if causal:
        ok = ok & (torch.arange(m)[None, :] <= torch.arange(n)[:, None] + m - n)
    return ok if keep is None else ok & keep[:, None, None, :]


# ------------------------------------------------------------ Katharopoulos et al. 2020


def linear_rnn(q, k, v, phi, eps, keep, causal):
    """out_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps), S_i = sum_{j visible} phi(k_j) v_j^T,
    accumulated key by key (the RNN of the paper's §3.4 when causal)."""
    b, h, n, _ = q.shape
    m = k.shape[2]
    ok = visible(n, m, keep, causal).expand(b, h, n, m)
    out = torch.zeros(b, h, n, v.shape[-1], dtype=D64)
    for i in range(n):
        s = torch.zeros(b, h, HD, v.shape[-1], dtype=D64)
        z = torch.zeros(b, h, HD, dtype=D64)
        for j in range(m):
            w = ok[:, :, i, j, None].to(D64)
            s = s + (w * phi(k[:, :, j]))[..., :, None] * v[:, :, j, None, :]
            z = z + w * phi(k[:, :, j])
        fq = phi(q[:, :, i])
        out[:, :, i] = (fq[..., None] * s).sum(-2) / ((fq * z).sum(-1) + eps)[..., None]
    return out


@pytest.mark.parametrize("spec, phi", [
    ("linear_elu", lambda x: F.elu(x) + 1), ("linear", lambda x: F.elu(x) + 1),
    ("linear_relu", F.relu), ("linear(feature_map='relu', chunk=4)", F.relu),
])
@pytest.mark.parametrize("n, m", [(1, 1), (11, 11), (5, 9), (9, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_linear_equals_the_papers_sums(spec, phi, n, m, causal):
    mech = build(spec)
    assert mech.cfg.eps == 1e-6  # fast-transformers' LinearAttention eps
    q, k, v = qkv(n, m, seed=n * 31 + m)
    keep = right_padded(m)
    close(run(mech, q, k, v, key_mask=keep, causal=causal),
          linear_rnn(q, k, v, phi, 1e-6, keep, causal))


# --------------------------------------------------------- Choromanski et al. 2021 (FAVOR+)


def favor_reference(q, k, v, w, scale, keep, causal):
    """phi(x) = exp(w^T x - |x|^2 / 2) / sqrt(m) on x * scale^(1/2) (d^-1/4 by default), no
    stabiliser; out = normalised phi(Q) phi(K)^T V over the visible keys."""
    def phi(x):
        x = x * scale**0.5
        return torch.exp(x @ w.T - x.square().sum(-1, keepdim=True) / 2) / math.sqrt(len(w))
    a = phi(q) @ phi(k).transpose(-1, -2) * visible(q.shape[2], k.shape[2], keep, causal)
    den = a.sum(-1, keepdim=True)
    return (a / torch.where(den > 0, den, 1.0)) @ v


@pytest.mark.parametrize("spec", ["performer(num_features=16)",
                                  "performer(num_features=5, orthogonal=False, chunk=4)"])
@pytest.mark.parametrize("n, m", [(1, 1), (13, 13), (6, 10), (10, 6)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_performer_equals_unstabilised_favor(spec, n, m, causal, scale):
    mech = build(spec)
    w = mech.projection(0, 0, dtype=D64)
    q, k, v = qkv(n, m, seed=n * 7 + m)
    keep = right_padded(m)
    close(run(mech, q, k, v, key_mask=keep, causal=causal, scale=scale),
          favor_reference(q, k, v, w, HD**-0.5 if scale is None else scale, keep, causal))


def test_favor_kernel_is_unbiased_for_the_softmax_kernel():
    """E[phi(q)^T phi(k)] = exp(q^T k) (Lemma 1): with 200k i.i.d. features the estimate is
    within 4 standard errors (the per-feature terms' own spread)."""
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(HD, generator=g, dtype=D64) * 0.4 for _ in range(2))
    w = torch.randn(200_000, HD, generator=g, dtype=D64)
    terms = torch.exp(w @ (q + k) - (q.square().sum() + k.square().sum()) / 2)
    est, err = terms.mean(), terms.std() / math.sqrt(len(terms))
    assert abs(est - torch.exp(q @ k)) < 4 * err


def test_performer_defaults_follow_the_issue():
    cfg = build("performer").cfg
    assert (cfg.redraw, cfg.orthogonal) == ("every_forward", True)
    w = build(f"performer(num_features={HD})").projection(0, 0, dtype=D64)  # one block of d
    gram = w @ w.T
    off = gram - torch.diag(torch.diag(gram))
    assert off.abs().max() < 1e-5 * gram.diag().max()  # orthogonal rows (drawn in fp32)


# -------------------------------------------------------------------- Wang et al. 2020


def linformer_reference(q, k, v, e, f, scale, keep):
    """softmax(Q (E K)^T * scale) (F V) with K, V zero-padded to the N columns of E, F and
    padded keys zeroed; e, f [k, N] or [h, k, N]."""
    if keep is not None:
        k, v = k * keep[:, None, :, None], v * keep[:, None, :, None]
    pad = e.shape[-1] - k.shape[2]
    k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))  # [b,h,N,d]
    e, f = e.expand(H, *e.shape[-2:]), f.expand(H, *f.shape[-2:])
    ek = torch.einsum("hkn,bhnd->bhkd", e, k)
    fv = torch.einsum("hkn,bhnd->bhkd", f, v)
    return torch.softmax(q @ ek.transpose(-1, -2) * scale, -1) @ fv


@pytest.mark.parametrize("share", ["none", "kv", "headwise", "layerwise"])
@pytest.mark.parametrize("kk", [4, 40])  # fewer, and more, projected rows than tokens
@pytest.mark.parametrize("m", [1, 7, 24])
def test_linformer_equals_zero_padded_projection(share, kk, m):
    mech = build(f"linformer(k={kk}, share='{share}')", max_len=24)
    e, f = mech.E.detach(), mech.value_proj.detach()
    assert (mech.F is None) == (share in ("kv", "layerwise"))  # E = F
    q, k, v = qkv(m, seed=m + kk)
    keep = right_padded(m)
    close(run(mech, q, k, v, key_mask=keep, scale=0.2),
          linformer_reference(q, k, v, e, f, 0.2, keep))


def test_linformer_right_padded_row_is_its_sequence_alone():
    mech = build("linformer(k=6)", max_len=24)
    q, k, v = qkv(20, b=1)
    keep = torch.arange(20)[None, :] < 13
    close(run(mech, q, k, v, key_mask=keep)[:, :, :13],
          run(mech, q[:, :, :13], k[:, :, :13], v[:, :, :13]))


# ------------------------------------------------------------------ Guo et al. 2019


@pytest.mark.parametrize("n", [1, 12, 300])  # 300: the band part's blocked engine
@pytest.mark.parametrize("causal", [False, True])
def test_lowrank_band_is_the_mean_of_two_softmaxes(n, causal):
    mech = build("lowrank_band(rank=3, window=2)")
    q, k, v = qkv(n, seed=n)
    keep = right_padded(n)
    ok = visible(n, n, keep, causal)
    pos = torch.arange(n)
    band = ok & ((pos[:, None] - pos[None, :]).abs() <= 2)
    qr = torch.einsum("bhnd,hdr->bhnr", q, mech.wq.detach())
    kr = torch.einsum("bhnd,hdr->bhnr", k, mech.wk.detach())
    ref = (dense_softmax(qr, kr, v, 3**-0.5, ok) + dense_softmax(q, k, v, HD**-0.5, band)) / 2
    close(run(mech, q, k, v, key_mask=keep, causal=causal), ref)


def test_lowrank_band_refuses_causal_with_unequal_lengths():
    """The band part reads raw positions, the low-rank softmax aligns queries to the last
    keys: causal with n != m would mix the two conventions, so it is refused."""
    mech = build("lowrank_band(rank=3, window=2)")
    q, k, v = qkv(5, 9)
    with pytest.raises(ValueError, match="n == m"):
        mech(q, k, v, AttnContext(causal=True))
    assert run(mech, q, k, v).shape == (2, H, 5, HD)  # bidirectional n != m still runs


# ------------------------------------------------------ Xiong et al. 2021 (Nystromformer)


def segment_means(x, num):
    """Loop form: position i of n in segment floor(i * num / n)."""
    n = x.shape[-2]
    seg = [[i for i in range(n) if i * num // n == s] for s in range(num)]
    return torch.stack([x[..., idx, :].mean(-2) for idx in seg], dim=-2)


def paper_pinv(a, iterations, per_matrix):
    """Eq. (16) of the paper (Razavi et al. 2014) from Z_0 = A^T / (||A||_1 ||A||_inf), the
    norms per matrix (the paper) or one maximum over the batch (the official code)."""
    n1 = a.abs().sum(-2).amax(-1, keepdim=True)[..., None]
    ninf = a.abs().sum(-1).amax(-1, keepdim=True)[..., None]
    norm = n1 * ninf if per_matrix else (n1 * ninf).max()
    z, eye = a.transpose(-1, -2) / norm, torch.eye(a.shape[-1], dtype=D64)
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def nystrom_reference(q, k, v, num, keep, per_matrix, conv_weight=None):
    """softmax(Q K~^T) Z softmax(Q~ K^T) V (+ depthwise conv of V), Q, K scaled by d^-1/4
    and zeroed where padded (the official code); exact softmax when num >= n."""
    n = q.shape[2]
    q, k = q * HD**-0.25 * keep[:, None, :, None], k * HD**-0.25 * keep[:, None, :, None]
    if num >= n:
        out = dense_softmax(q, k, v, 1.0, visible(n, n, keep, False))
    else:
        ql, kl = segment_means(q, num), segment_means(k, num)
        k1 = torch.softmax(q @ kl.transpose(-1, -2), -1)
        z = paper_pinv(torch.softmax(ql @ kl.transpose(-1, -2), -1), 6, per_matrix)
        k3 = dense_softmax(ql, k, v, 1.0, visible(num, n, keep, False))
        out = k1 @ z @ k3
    if conv_weight is not None:  # [h, K]: out_i += sum_t w_t v_{i + t - K//2}
        half = conv_weight.shape[1] // 2
        vp = F.pad(v * keep[:, None, :, None], (0, 0, half, half))  # vp[j + half] = v[j]
        for t in range(conv_weight.shape[1]):
            out = out + conv_weight[None, :, t, None, None] * vp[:, :, t:t + n]
    return out


@pytest.mark.parametrize("n", [1, 3, 16, 19])  # 1, 3: fewer tokens than landmarks
@pytest.mark.parametrize("init", ["original", "exact"])
@pytest.mark.parametrize("conv", [0, 3])
def test_nystrom_equals_the_papers_formula(n, init, conv):
    mech = build(f"nystrom(num_landmarks=4, pinv_init='{init}', conv_kernel={conv})")
    assert mech.cfg.pinv_iterations == 6  # the paper's
    q, k, v = qkv(n, seed=n)
    keep = right_padded(n)
    out = run(mech, q, k, v, key_mask=keep)
    w = mech.conv.weight.detach()[:, 0, :, 0] if conv else None
    ref = nystrom_reference(q, k, v, 4, keep, init == "exact", w)
    real = keep[:, None, :, None].expand_as(out)  # padded query rows are not specified
    close(out[real], ref[real])


def test_nystrom_float32_module_keeps_float64_and_bf16_inputs():
    """The conv skip's weight follows the input dtype, as the other mechanisms' parameters
    (a float32 module called on float64 inputs used to fail in Conv2d)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        mech = attnlab.build_mechanism("nystrom(num_landmarks=4, conv_kernel=3)",
                                       HeadDims(H, HD))
    q, k, v = qkv(10)
    res = mech(q, k, v, AttnContext(need_weights=True))
    assert res.out.dtype == res.probs.dtype == D64
    close(res.out, mech.double()(q, k, v, AttnContext()).out, 1e-13)
    close(res.probs @ v, res.out)
    low = mech.float()(*(t.bfloat16() for t in (q, k, v)), AttnContext()).out
    assert low.dtype == torch.bfloat16


# --------------------------------------------------------------- Chen et al. 2020 (CSALR)


def csalr_reference(q, k, v, num, eps, keep):
    """Per row, over its real tokens only: softmax(s Q K~^T) (M + eps I)^{-1} softmax(s Q~ K^T)
    V with M = softmax(s Q~ K~^T), an explicit inverse, L capped at the row's length."""
    out = torch.zeros_like(v)
    for b in range(q.shape[0]):
        idx = keep[b].nonzero().flatten()
        if len(idx) == 0:
            continue  # no real token: 0
        qq, kk, vv = q[b][:, idx], k[b][:, idx], v[b][:, idx]
        num_b, s = min(num, len(idx)), HD**-0.5
        ql, kl = segment_means(qq, num_b), segment_means(kk, num_b)
        inv = torch.linalg.inv(torch.softmax(ql @ kl.transpose(-1, -2) * s, -1)
                               + eps * torch.eye(num_b, dtype=D64))
        out[b][:, idx] = (torch.softmax(qq @ kl.transpose(-1, -2) * s, -1) @ inv
                          @ torch.softmax(ql @ kk.transpose(-1, -2) * s, -1) @ vv)
    return out


@pytest.mark.parametrize("n", [1, 3, 16, 19])
@pytest.mark.parametrize("eps", [1.0, 0.01])
def test_csalr_equals_the_explicit_inverse(n, eps):
    mech = build(f"csalr(num_landmarks=4, eps={eps})")
    assert build("csalr").cfg.eps == 1.0  # the survey's "adds an identity matrix to M"
    q, k, v = qkv(n, seed=n + 100)
    keep = right_padded(n)
    close(run(mech, q, k, v, key_mask=keep), csalr_reference(q, k, v, 4, eps, keep), 1e-9)


# ------------------------------------------------------------------------ all of them


@pytest.mark.parametrize("spec, max_len", [
    ("linear_elu", None), ("linear_relu", None), ("performer(num_features=8)", None),
    ("linformer(k=4, share='none')", 16), ("lowrank_band(rank=2, window=1)", None),
    ("nystrom(num_landmarks=3, conv_kernel=3)", None), ("nystrom(num_landmarks=8)", None),
    ("csalr(num_landmarks=3)", None),
])
@pytest.mark.parametrize("n", [1, 7])
def test_float64_gradients_match_finite_differences(spec, max_len, n):
    """gradcheck (fast mode: random directions) in float64 over q, k, v, with a fully
    padded batch row (its output 0)."""
    mech = build(spec, max_len)
    keep = torch.ones(2, n, dtype=torch.bool)
    keep[1] = False
    q, k, v = (t.requires_grad_() for t in qkv(n, seed=n))
    causal = mech.caps.causal_ok

    def fn(q, k, v):
        return mech(q, k, v, AttnContext(key_mask=keep, causal=causal)).out

    assert fn(q, k, v)[1].abs().max() == 0
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-5, rtol=1e-4, fast_mode=True)
