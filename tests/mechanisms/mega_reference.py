"""Naive float64 references of MEGA (Ma et al., ICLR 2023) for ``test_mega.py``: the damped
EMA by its recurrence (eq. 2-3), the official Laplace function with its published constants,
and the whole layer (eq. 6-15) with loops over queries."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnlab.mechanisms._ema import DampedEMA


def naive_ema(ema: DampedEMA, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """X' = silu(y + omega x) with y from the recurrence of eq. 2-3, token by token (float64):
    h_t = alpha beta x_t + (1 - alpha delta) h_{t-1}, y_t = eta^T h_t / sqrt(N); the
    bidirectional form adds the backward recurrence (h_t from h_{t+1}) with its own
    parameters. x [b, n, D] (padding already zeroed)."""
    x = x.double()
    b, n, ch = x.shape
    alpha = torch.sigmoid(ema.alpha_raw.double())
    delta = torch.sigmoid(ema.delta_raw.double())
    ab, q = alpha * ema.beta.double(), 1 - alpha * delta  # [2,D,N]
    w = ema.eta.double() / math.sqrt(ema.ndim)
    y = torch.zeros(b, n, ch, dtype=torch.float64)
    for k in (0,) if causal else (0, 1):
        h = torch.zeros(b, ch, ema.ndim, dtype=torch.float64)
        for t in range(n) if k == 0 else reversed(range(n)):
            h = ab[k] * x[:, t, :, None] + q[k] * h
            y[:, t] += (h * w[k]).sum(-1)
    return F.silu(y + x * ema.omega.double())


def official_laplace(x):
    """The official utils.laplace with its published constants."""
    return 0.5 * (1 + torch.erf((x - 0.707107) / (0.282095 * math.sqrt(2.0))))


def exact_laplace(x):
    """f_laplace with the paper's exact constants mu = sqrt(1/2), sigma = sqrt(1/(4 pi)) (the
    official code rounds them to 6 digits, ~1e-6 apart): the float64 tests' reference."""
    mu, sigma = math.sqrt(0.5), math.sqrt(0.25 / math.pi)
    return 0.5 * (1 + torch.erf((x - mu) / (sigma * math.sqrt(2.0))))


def naive_mega(mech, v, key_mask=None, causal=False, drop=None, laplace=official_laplace):
    """Eq. 6-15 in float64 with loops: the EMA by recurrence, each query's weights over the
    keys it sees (its chunk, unpadded, j <= i if causal), the relative bias w[P-1+j-i].
    ``drop(x, p)``: the layer's own dropouts where the official layer has them (X', V, H).
    ``laplace``: the Laplace function (default the official one, rounded constants).
    Returns (out [b,h,n,d], map [b,n,n])."""
    cfg = mech.cfg
    b, h, n, d = v.shape
    x = v.transpose(1, 2).reshape(b, n, h * d).double()
    keep = torch.ones(b, n, dtype=torch.bool) if key_mask is None else key_mask
    x = x * keep[..., None]
    W = {name: p.double() for name, p in mech.named_parameters()}
    xe = naive_ema(mech.ema, x, causal)  # X' (eq. 6)
    value = F.silu(x @ W["value.weight"].T + W["value.bias"])  # V (eq. 10)
    if drop is not None:  # official: self.dropout(mx), self.hidden_dropout(v)
        xe, value = drop(xe, cfg.dropout), drop(value, cfg.hidden_dropout)
    proj = xe @ W["from_ema.weight"].T + W["from_ema.bias"]
    z, gamma, phi, hx = proj.split([cfg.zdim, mech.hv, h * d, h * d], -1)
    z, gamma, phi = F.silu(z), F.silu(gamma), torch.sigmoid(phi)  # eq. 7, 12, 13
    qz = z * W["kappa"][0] + W["mu"][0]  # eq. 8
    kz = z * W["kappa"][1] + W["mu"][1]  # eq. 9
    c = cfg.chunk or n
    o = torch.zeros(b, n, mech.hv, dtype=torch.float64)
    amap = torch.zeros(b, n, n, dtype=torch.float64)
    for bi in range(b):
        for i in range(n):
            start = (i // c) * c
            keys = [j for j in range(start, min(start + c, n))
                    if keep[bi, j] and (not causal or j <= i)]
            if not keys:
                continue
            js = torch.tensor(keys)
            s = kz[bi, js] @ qz[bi, i]  # [|keys|]
            rel = W["rel_bias"][mech.span - 1 + js - i]
            if cfg.attention_fn == "softmax":
                p = torch.softmax(s / math.sqrt(cfg.zdim) + rel, -1)
            else:
                p = laplace(s / len(keys) + rel)
            o[bi, i] = p @ value[bi, js]  # eq. 11
            amap[bi, i, js] = p
    hid = F.silu(hx + (gamma * o) @ W["out_gate.weight"].T + W["out_gate.bias"])  # eq. 14
    if drop is not None:  # official: self.dropout(h)
        hid = drop(hid, cfg.dropout)
    y = (phi * hid + (1 - phi) * x) * keep[..., None]  # eq. 15; padded positions 0
    amap = amap * keep[..., None]
    return y.view(b, n, h, d).transpose(1, 2), amap
