"""The layout of the blocked sparse-attention engine (``_blocksparse``): every sequence's
query blocks and key windows in one flat array, the rows of q, K, V and dO read in place
where they can be, and the chunks of whole blocks the engine loops over.
"""

from __future__ import annotations

import os

import torch


# Target number of score elements per chunk (fp32: 4 MiB). The forward+backward peak holds
# ~4 chunk buffers, so smaller chunks save memory, and they stay in cache: against 4 Mi,
# 1 Mi took band(128) at n = 4096 from 118 to 98 MB and from 311 to 255 ms fwd+bwd on one
# thread (docs/benchmarks-history.md, "Chunk size"). Larger chunks mean fewer parallel regions,
# which helped on a busy machine with several threads (4 Mi was about 2x faster than 2 Mi
# there, in an earlier uncommitted comparison).
# ATTNLAB_CHUNK_ELEMS overrides it for the process (read once, at import: the forward and
# its backward must chunk alike, since the dropout masks are drawn per chunk).
def _chunk_elems(raw: str | None, default: int = 1 << 20) -> int:
    """ATTNLAB_CHUNK_ELEMS as a positive number of scores (``default`` when unset)."""
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"ATTNLAB_CHUNK_ELEMS must be a positive whole number of scores, got "
                         f"{raw!r}; unset it for the default {default}")
    return value


# a bad value must not break ``import attnlab``: it is reported by the CLI (one line) and
# by the engine's first call
try:
    CHUNK_ELEMS, CHUNK_ENV_ERROR = _chunk_elems(os.environ.get("ATTNLAB_CHUNK_ELEMS")), None
except ValueError as e:
    CHUNK_ELEMS, CHUNK_ENV_ERROR = 1 << 20, str(e)


class _Layout:
    """Flat padded layout shared by forward and backward (all sizes in rows)."""

    def __init__(self, n: int, block: int, left: int, width: int, seqs: int,
                 extras: int = 0) -> None:
        self.n, self.B, self.P, self.L, self.S = n, block, left, width, seqs
        self.W = width + extras  # scores per query: the window's L and the R extra keys
        self.nqb = -(-n // block)
        self.np = self.nqb * block
        self.T = seqs * self.nqb  # total query blocks
        self.rows = (self.T + width // block - 1) * block  # flat key rows incl. pads

    def pad_queries(self, x: torch.Tensor) -> torch.Tensor:
        """[S, n, d] -> [S, np, d] (contiguous; a view when n == np)."""
        if self.np == self.n:
            return x.contiguous()
        out = x.new_zeros(self.S, self.np, x.shape[-1])
        out[:, : self.n] = x
        return out

    def pad_keys(self, x: torch.Tensor) -> torch.Tensor:
        """[S, n, d] -> flat [rows, d] with sequence s at rows P + s*np .. (zeros elsewhere)."""
        out = x.new_empty(self.rows, x.shape[-1])
        out[: self.P].zero_()  # pads must be finite: masked keys still enter the GEMMs
        out[self.P + self.S * self.np :].zero_()
        seq = self.seq_view(out)
        seq[:, self.n :].zero_()
        seq[:, : self.n] = x
        return out

    def seq_view(self, flat: torch.Tensor) -> torch.Tensor:
        """Flat [rows, d] -> [S, np, d] view of the real sequence rows."""
        return flat[self.P : self.P + self.S * self.np].view(self.S, self.np, flat.shape[-1])

    def window_t(self, flat: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """Transposed key windows of blocks t0..t1: [t1-t0, d, L] view (no copy)."""
        return flat[t0 * self.B : t1 * self.B + self.L - self.B].unfold(0, self.L, self.B)


class _KeyRows:
    """The keys (or values) in the flat padded layout, copied only where they must be.

    Three forms, by what the input x [S, n, d] allows (``of``):

    * ``flat``: x contiguous and n a multiple of B. The flat layout is x's [S*n, d] rows
      with P zero rows before them and L-B-P after, so a window is a view of x shifted by
      P rows; only windows that reach past either end (the first blocks of the first
      sequence, the last of the last) are built as a small zero-padded copy of their rows.
    * ``strided``: x not contiguous (a transposed [b, n, h, d] projection output, as
      encoders pass it) with n a multiple of B, and chunks inside one sequence. A window
      is a view of that sequence's strided rows; the blocks whose window reaches outside
      the sequence take a small zero-padded copy.
    * ``padded``: otherwise, the whole zero-padded copy ``_Layout.pad_keys`` makes.

    The first two copy nothing of size [S, n, d], and the backward saves x itself.
    """

    def __init__(self, lay: _Layout, x: torch.Tensor, form: str) -> None:
        self.lay, self.x, self.form = lay, x, form  # x: [S, n, d], or flat [rows, d] if padded
        self.seq = lay.seq_view(x) if form == "padded" else x  # [S,np,d]

    @classmethod
    def of(cls, lay: _Layout, x: torch.Tensor, within_sequences: bool) -> _KeyRows:
        """From the input x [S, n, d]; ``within_sequences``: every chunk lies inside one
        sequence (``_chunks``' second case)."""
        if lay.np != lay.n:
            return cls(lay, lay.pad_keys(x), "padded")
        if x.is_contiguous():
            return cls(lay, x, "flat")
        if within_sequences and x.stride(-1) == 1:
            return cls(lay, x, "strided")
        return cls(lay, x.contiguous(), "flat")

    def window_t(self, t0: int, t1: int) -> torch.Tensor:
        """Transposed key windows of blocks t0..t1: [t1-t0, d, L] (``_Layout.window_t``)."""
        lay = self.lay
        if self.form == "padded":
            return lay.window_t(self.x, t0, t1)
        if self.form == "flat":
            rows = self.x.view(-1, self.x.shape[-1])  # [S*n,d]: flat row r + P of the layout
            lo = t0 * lay.B - lay.P
        else:  # the rows of one sequence; chunks never cross sequences here
            s, u0 = divmod(t0, lay.nqb)
            rows, lo = self.x[s], u0 * lay.B - lay.P  # [n,d], strided rows
        hi = lo + (t1 - t0 - 1) * lay.B + lay.L
        if lo < 0 or hi > rows.shape[0]:  # reaches into the zero rows: copy these rows
            part = rows.new_zeros(hi - lo, rows.shape[-1])
            a, b = max(lo, 0), min(hi, rows.shape[0])
            part[a - lo : b - lo] = rows[a:b]
            rows, lo, hi = part, 0, hi - lo
        return rows[lo:hi].unfold(0, lay.L, lay.B)


class _QueryRows:
    """Query-side rows (q, or the output's gradient) as blocks [T, B, d], copied only where
    they must be: a view when x [S, n, d] splits into blocks as it is (contiguous, or
    expanded), per-sequence strided views when x is a transposed input and chunks lie inside
    one sequence (as ``_KeyRows``), else a contiguous (zero-padded) copy."""

    def __init__(self, lay: _Layout, x: torch.Tensor, inside: bool) -> None:
        """x [S, n, d], or [S, np, d] already padded (what the forward saved)."""
        self.lay = lay
        self.flat: torch.Tensor | None = None
        if x.shape[1] != lay.np:
            x = lay.pad_queries(x)  # [S,np,d] contiguous
        try:
            self.flat = x.view(lay.T, lay.B, x.shape[-1])  # [T,B,d]
        except RuntimeError:  # strides that do not merge sequences and blocks
            if not (inside and x.stride(-1) == 1):
                x = x.contiguous()
                self.flat = x.view(lay.T, lay.B, x.shape[-1])
        self.seq = x  # [S,np,d]

    def blocks(self, t0: int, t1: int) -> torch.Tensor:
        """Rows of query blocks t0..t1: [t1-t0, B, d] (a view)."""
        if self.flat is not None:
            return self.flat[t0:t1]
        lay = self.lay
        s, u0 = divmod(t0, lay.nqb)  # one sequence: chunks never cross sequences here
        rows = self.seq[s, u0 * lay.B : (u0 + t1 - t0) * lay.B]  # [Tc*B,d], strided
        return rows.view(t1 - t0, lay.B, rows.shape[-1])


def _within_sequences(lay: _Layout, elems: int | None = None) -> bool:
    """Whether ``_chunks`` cuts inside sequences (a sequence holds more than a chunk of
    ``elems`` scores, CHUNK_ELEMS by default)."""
    return lay.nqb * lay.B * lay.W > (CHUNK_ELEMS if elems is None else elems)


def _chunks(lay: _Layout, groups: int, elems: int | None = None):
    """(gi, s0, s1, u0, u1): whole sequences s0..s1 of bias group gi, or blocks u0..u1 of
    one sequence, about ``elems`` scores each (CHUNK_ELEMS by default; a smaller value
    only cuts finer, which every row form of a layout built for CHUNK_ELEMS allows). A
    group is a batch element when the bias depends on it (key mask), else all b*h
    sequences form one group (``groups`` = 1)."""
    elems = CHUNK_ELEMS if elems is None else elems
    nqb = lay.nqb
    per_group, per_block = lay.S // groups, lay.B * lay.W
    if not _within_sequences(lay, elems):
        sc = max(1, elems // (nqb * per_block))
        for gi in range(groups):
            for s0 in range(gi * per_group, (gi + 1) * per_group, sc):
                yield gi, s0, min(s0 + sc, (gi + 1) * per_group), 0, nqb
    else:
        uc = max(1, elems // per_block)
        for gi in range(groups):
            for s in range(gi * per_group, (gi + 1) * per_group):
                for u0 in range(0, nqb, uc):
                    yield gi, s, s + 1, u0, min(u0 + uc, nqb)


def _span(lay: _Layout, c) -> tuple[int, int]:
    """First and one-past-last flat query block of chunk c."""
    _, s0, s1, u0, u1 = c
    return s0 * lay.nqb + u0, (s1 - 1) * lay.nqb + u1
