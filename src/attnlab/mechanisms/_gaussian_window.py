"""Fixed Gaussian attention over positions as a depthwise convolution: ``hardcoded_gaussian``'s
path at length, O(n * W) instead of the [h, n, m] prior.

The weights softmax_j(-(j - c_i)^2 / (2 sigma^2) + masks) (centre c_i = p_i + o_t, p_i the
query's key position) do not depend on q or k. In a dtype, a term whose logit is below the
row's largest by more than ``cutoff`` (= -log(tiny) - log(eps): ~103 in float32, ~745 in
float64) is below the smallest normal number relative to the largest term and below the
sum's rounding, so only keys within R = ceil(sigma sqrt(2 cutoff)) of the centre count.
Then, with the masked values vm_j = visible_j v_j and the kernel g_t(l) = exp(-(l - o_t)^2 /
(2 sigma^2)) over the lags l = j - p_i in [min o - R, max o + R] (cut at 0 when causal):

    out_i = sum_l g_t(l) vm_(p_i + l) / Z_i,   Z_i = sum_l g_t(l) visible_(p_i + l)

two depthwise ``conv1d`` (values, and the visible mask for Z), whose backward autograd
keeps as the masked values alone. This equals the dense softmax to the dtype's rounding
for every row with Z_i >= W * tiny / eps (W lags): its terms are normal numbers and those
cut off are below eps of Z_i. A row below that (its centre far from every visible key: a
query deep in the padding) is computed exactly around its nearest visible key instead
(``_far_rows``): with d0 the distance from the centre to that key, the logits shifted by
d0^2 / (2 sigma^2) make the largest 0, and the keys that count lie within R of c -/+ d0,
so two windows of R + 1 keys each. A row with no visible key at all gives 0.

Shapes: b batch, h heads, n queries, m keys, d value dim, W lags, r far rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FAST_DTYPES = (torch.float32, torch.float64)


def cutoff(dtype: torch.dtype) -> float:
    """Logit gap beyond which a term no longer reaches the sum in ``dtype``."""
    info = torch.finfo(dtype)
    return -math.log(info.tiny) - math.log(info.eps)


def radius(sigma: float, dtype: torch.dtype) -> int:
    """R: the distance from the centre beyond which no key reaches the sum in ``dtype``."""
    return math.ceil(sigma * math.sqrt(2 * cutoff(dtype)))


def window_lags(offsets: list[int], sigma: float, dtype: torch.dtype, causal: bool
                ) -> tuple[int, int]:
    """(lo, hi): the lags j - p_i the convolution covers (W = hi - lo + 1)."""
    r = radius(sigma, dtype)
    lo, hi = min(offsets) - r, max(offsets) + r
    return lo, min(hi, 0) if causal else hi


def gaussian_window(v: torch.Tensor, n: int, offsets: list[int], sigma: float,
                    key_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """softmax_j(-(j - p_i - o_t)^2 / (2 sigma^2) + masks) V -> [b, h, n, d] (module
    docstring); v [b, h, m, d] float32 or float64, offsets o_t per head (h ints), queries
    aligned to the last n <= m keys (p_i = i + m - n), key_mask [b, m] (True = key) or None,
    causal: j <= p_i."""
    b, h, m, d = v.shape
    lo, hi = window_lags(offsets, sigma, v.dtype, causal)
    W = hi - lo + 1
    lags = torch.arange(lo, hi + 1, device=v.device, dtype=torch.float64)
    offs = torch.tensor(offsets, device=v.device, dtype=torch.float64)
    kernel = torch.exp(-(lags[None] - offs[:, None]).square() / (2 * sigma**2))  # [h,W]
    kernel = kernel.to(v.dtype)
    visible = (torch.ones(b, m, dtype=v.dtype, device=v.device) if key_mask is None
               else key_mask.to(device=v.device, dtype=v.dtype).expand(b, m))  # [b,m]
    left, right = max(0, -(m - n + lo)), max(0, hi)  # zero keys beyond both ends
    start = left + m - n + lo  # conv output t reads keys t - left + (0..W-1): query 0's
    vm = (v * visible[:, None, :, None]).permute(0, 1, 3, 2).reshape(b, h * d, m)
    y = F.conv1d(F.pad(vm, (left, right)), kernel.repeat_interleave(d, 0)[:, None],
                 groups=h * d)[..., start:start + n]  # [b,h*d,n]
    z = F.conv1d(F.pad(visible[:, None], (left, right)), kernel[:, None])[..., start:start + n]
    info = torch.finfo(v.dtype)
    near = z >= W * info.tiny / info.eps  # [b,h,n]: rows the window covers exactly
    out = (y.view(b, h, d, n) / torch.where(near, z, 1.0)[:, :, None]).transpose(2, 3)
    if bool(near.all()):
        return out  # [b,h,n,d]
    far = (~near).nonzero(as_tuple=True)  # (bi, hi, ii) [r] each
    return out.index_put(far, _far_rows(v, far, n, offsets, sigma, visible > 0, causal))


def _far_rows(v: torch.Tensor, far: tuple[torch.Tensor, ...], n: int, offsets: list[int],
              sigma: float, visible: torch.Tensor, causal: bool) -> torch.Tensor:
    """The rows ``far`` [r] of the output, each around its nearest visible key (module
    docstring): [r, d]; 0 for a row with no visible key."""
    b, h, m, d = v.shape
    bi, hi, ii = far
    dev = v.device
    pos = ii + (m - n)  # p_i [r]
    centre = pos + torch.tensor(offsets, device=dev)[hi]  # c [r]
    # nearest visible key at or left of x / at or right of x (-1 / m: none), per sequence
    idx = torch.arange(m, device=dev)
    last = torch.where(visible, idx, -1).cummax(-1).values  # [b,m]
    first = torch.where(visible, idx, m).flip(-1).cummin(-1).values.flip(-1)  # [b,m]
    at_left = torch.where(centre >= 0, last[bi, centre.clamp(0, m - 1)], -1)
    at_right = torch.where(centre <= m - 1, first[bi, centre.clamp(0, m - 1)], m)
    if causal:  # keys after p_i do not count
        at_right = torch.where(at_right <= pos, at_right, m)
        at_left = torch.minimum(at_left, last[bi, pos])
    inf = 2 * (m + abs(min(offsets)) + abs(max(offsets)) + 1)
    d_left = torch.where(at_left >= 0, centre - at_left, inf)
    d_right = torch.where(at_right < m, at_right - centre, inf)
    d0 = torch.minimum(d_left, d_right)  # [r]
    span = torch.arange(radius(sigma, v.dtype) + 1, device=dev)
    keys = torch.cat([(centre - d0)[:, None] - span.flip(0), (centre + d0.clamp(min=1))[:, None]
                      + span], 1)  # [r,2R+2]: c - d0 - R .. c - d0, c + d0 .. c + d0 + R
    ok = (keys >= 0) & (keys < m) & (d0 < inf)[:, None]
    if causal:
        ok &= keys <= pos[:, None]
    safe = keys.clamp(0, m - 1)
    ok &= visible[bi[:, None], safe]
    gap = (keys - centre[:, None]).to(torch.float64)
    logits = -(gap.square() - d0.to(torch.float64)[:, None].square()) / (2 * sigma**2)
    logits = logits.to(v.dtype).masked_fill(~ok, float("-inf"))
    w = torch.softmax(logits, -1).nan_to_num(0.0)  # [r,2R+2]; no key: 0
    return (w[..., None] * v[bi[:, None], hi[:, None], safe]).sum(1)  # [r,d]
