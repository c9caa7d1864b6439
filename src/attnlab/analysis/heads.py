"""Head scorers and the head classifier over captured attention maps.

Why this module exists: PASTA (Yang et al., EACL 2023) tunes only the vectors at special-token
positions because many BERT heads are "vertical" (every token attends to [CLS]/[SEP]); TLM
(Yao et al., ICML 2022) reports fewer vertical and more heterogeneous heads in task-driven
models; Kovaleva et al. (2019) sorted heads into vertical, diagonal, vertical+diagonal, block
and heterogeneous; Clark et al. (2019) measured entropy and the mass on special and
neighbouring tokens. This module turns captured maps into [layers, heads] tables of those
statistics and into one class per head.

Inputs are plain tensors: ``maps`` is a tensor [L, b, h, n, n], a sequence of per-layer
[b, h, n, n] tensors, or a mapping layer -> [b, h, n, n] (what ``capture_attention``
returns). ``infos`` holds one :class:`TokenInfo` per example. Padding is cropped per
example: only the real n_i x n_i block of example i counts, and the probabilities are used as
captured (no renormalisation), so values at padded positions never change a score.

Argmax ties: a row whose maximum is attained at k positions gives each of them 1/k of the
row's vote. Real softmax maps almost never tie, so this equals ``torch.argmax`` there; on
constructed maps (a uniform row) it avoids calling a head "vertical" only because argmax
returns the first index. The PASTA code uses plain argmax (first index on ties).

Every score is computed per example and then averaged over examples (a streaming mean in
float64, see :class:`HeadScoreAccumulator`), so a dev set never has to sit in memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, cast

import torch
from torch import Tensor

from attnlab.core import Registry

# TokenInfo and token_infos live in tokens.py; re-exported here for older imports.
from .tokens import TokenInfo as TokenInfo
from .tokens import token_infos as token_infos

# The classifier's labels, in the order it checks them (see ClassRule); NO_CLASS marks a head
# whose layer had no maps (its f_V or f_D is NaN).
NO_CLASS = "n/a"
HEAD_CLASSES: tuple[str, ...] = (
    "vertical", "diagonal", "vertical+diagonal", "block", "heterogeneous"
)


# ----------------------------------------------------------------------------- one example


class HeadView:
    """One example's cropped maps of one layer, p [h, n_i, n_i], with shared derived tensors."""

    def __init__(self, p: Tensor, info: TokenInfo) -> None:
        self.p = p  # [h, n, n] probabilities of the real block, as captured
        self.info = info
        self._top: Tensor | None = None

    @property
    def n(self) -> int:
        return self.p.shape[-1]

    @property
    def top(self) -> Tensor:
        """[h, n, n] argmax vote: 1 at a row's maximum, split 1/k over k tied maxima."""
        if self._top is None:
            hit = (self.p == self.p.amax(-1, keepdim=True)).to(self.p.dtype)  # [h, n, n]
            self._top = hit / hit.sum(-1, keepdim=True)
        return self._top

    def row_share(self, keys: Tensor) -> Tensor:
        """[h]: mean over rows of the argmax vote landing on the ``keys`` ([n] bool) set."""
        return (self.top @ keys.to(self.p.dtype)).mean(-1)  # [h, n] @ ... -> [h]

    def offset_share(self, offsets: Sequence[int]) -> Tensor:
        """[h]: mean over all n rows of the argmax vote landing on key i + k, k in offsets."""
        total = sum((torch.diagonal(self.top, k, dim1=-2, dim2=-1).sum(-1) for k in offsets),
                    torch.zeros((), dtype=self.p.dtype))
        return total / self.n


class HeadScorer(Protocol):
    """A frozen dataclass with a class-level ``name``; returns [h] per (example, layer).

    Returning None excludes the example from this score's mean (e.g. ``block`` on a
    single-segment input).
    """

    name: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, Any]]  # a dataclass (dataclasses.fields works)

    def __call__(self, view: HeadView) -> Tensor | None: ...


SCORERS: Registry[type] = Registry("head scorer", example="vertical_pasta(cutoff=0.8)")


def register_scorer(cls: type) -> type:
    """Class decorator: register a frozen scorer dataclass under its ``name``."""
    name = getattr(cls, "name", "")
    if not dataclasses.is_dataclass(cls) or not name:
        raise TypeError(f"{cls.__name__} must be a dataclass with a class-level name")
    SCORERS.register(name, cls)
    return cls


@register_scorer
@dataclass(frozen=True, kw_only=True)
class Vertical:
    """Share of rows whose argmax is a special token ([CLS] or any [SEP])."""

    name: ClassVar[str] = "vertical"

    def __call__(self, view: HeadView) -> Tensor:
        return view.row_share(view.info.special)


@register_scorer
@dataclass(frozen=True, kw_only=True)
class VerticalTLM:
    """Share of rows whose argmax is a special token or "." (the TLM paper's criterion)."""

    name: ClassVar[str] = "vertical_tlm"

    def __call__(self, view: HeadView) -> Tensor:
        return view.row_share(view.info.special | view.info.period)


@register_scorer
@dataclass(frozen=True, kw_only=True)
class VerticalPASTA:
    """Share of examples where >= cutoff of rows have their argmax at 0 or the last real token.

    The PASTA code's ``is_vertical`` (``plot_attentions.py``: count >= n * cutoff), with a
    1e-6 slack so that float products such as 0.7 * 10 = 7.000000000000001 do not flip the
    comparison. A row's argmax is its first maximum, as that code's ``argmax`` takes it (a
    row tied between position 0 and a word counts; the other scores split tied votes).
    """

    name: ClassVar[str] = "vertical_pasta"
    cutoff: float = 0.9  # share of rows that must point at the first or last token

    def __post_init__(self) -> None:
        if not 0.0 <= self.cutoff <= 1.0:
            raise ValueError(f"vertical_pasta cutoff must be in [0, 1], got {self.cutoff}")

    def __call__(self, view: HeadView) -> Tensor:
        first = view.p.argmax(-1)  # [h, n]: each row's first maximum
        count = ((first == 0) | (first == view.n - 1)).sum(-1)  # [h] rows pointing at an end
        return (count >= self.cutoff * view.n - 1e-6).to(view.p.dtype)


@register_scorer
@dataclass(frozen=True, kw_only=True)
class Diagonal:
    """Share of rows whose argmax is the previous or the next token (i-1 or i+1)."""

    name: ClassVar[str] = "diagonal"

    def __call__(self, view: HeadView) -> Tensor:
        return view.offset_share((-1, 1))


@register_scorer
@dataclass(frozen=True, kw_only=True)
class Block:
    """Share of rows whose argmax is a non-special token of the row's own segment.

    Defined on pair inputs only: in a single segment it would count every non-special
    argmax (diagonal and heterogeneous heads alike) and say nothing about segments, so
    single-segment examples are left out of the mean; the score is NaN when no example
    in the data is a pair.
    """

    name: ClassVar[str] = "block"

    def __call__(self, view: HeadView) -> Tensor | None:
        info = view.info
        if not info.is_pair:
            return None
        assert info.segment is not None  # is_pair implies a segment
        same = info.segment[:, None] == info.segment[None, :]  # [n, n] query i, key j
        target = (same & ~info.special[None, :]).to(view.p.dtype)  # [n, n]
        return (view.top * target).sum(-1).mean(-1)


@register_scorer
@dataclass(frozen=True, kw_only=True)
class Entropy:
    """Mean row entropy in nats (Clark et al. 2019); log n for uniform rows, 0 for one-hot.
    NaN for a head whose map has a negative weight (the Nystrom, Linformer and CSALR
    approximations): it is not a distribution and has no entropy (``entr`` would give
    -inf, which a selection such as ``entropy<1.5`` would take for a peaked head)."""

    name: ClassVar[str] = "entropy"

    def __call__(self, view: HeadView) -> Tensor:
        ent = torch.special.entr(view.p).sum(-1).mean(-1)  # [h]
        return ent.masked_fill((view.p < 0).flatten(1).any(-1), float("nan"))


@register_scorer
@dataclass(frozen=True, kw_only=True)
class SpecialMass:
    """Mean attention mass a row puts on special tokens (Clark et al. 2019)."""

    name: ClassVar[str] = "special_mass"

    def __call__(self, view: HeadView) -> Tensor:
        return view.p[..., view.info.special].sum(-1).mean(-1)


@register_scorer
@dataclass(frozen=True, kw_only=True)
class PrevMass:
    """Mean mass on the previous token, over rows 1..n-1 (row 0 has no previous token)."""

    name: ClassVar[str] = "prev_mass"

    def __call__(self, view: HeadView) -> Tensor | None:
        if view.n < 2:
            return None
        return torch.diagonal(view.p, offset=-1, dim1=-2, dim2=-1).mean(-1)


@register_scorer
@dataclass(frozen=True, kw_only=True)
class NextMass:
    """Mean mass on the next token, over rows 0..n-2 (the last row has no next token)."""

    name: ClassVar[str] = "next_mass"

    def __call__(self, view: HeadView) -> Tensor | None:
        if view.n < 2:
            return None
        return torch.diagonal(view.p, offset=1, dim1=-2, dim2=-1).mean(-1)


DEFAULT_SCORERS: tuple[str, ...] = (
    "vertical",
    "vertical_tlm",
    "vertical_pasta",
    "diagonal",
    "block",
    "entropy",
    "special_mass",
    "prev_mass",
    "next_mass",
)

ScorerSpec = str | Mapping[str, Any] | HeadScorer


def build_scorer(spec: ScorerSpec) -> HeadScorer:
    """``"vertical_pasta(cutoff=0.8)"``, ``{"name": "diagonal"}`` or an instance -> scorer."""
    return SCORERS.config(spec)


def scorer_label(scorer: HeadScorer) -> str:
    """Table key: the bare name at default settings, else ``name(key=value, ...)``."""
    changed = [
        f"{f.name}={getattr(scorer, f.name)!r}"
        for f in dataclasses.fields(scorer)
        if getattr(scorer, f.name) != f.default
    ]
    return f"{scorer.name}({', '.join(changed)})" if changed else scorer.name


# ----------------------------------------------------------------------------- accumulation

# [L, b, h, n, n], or per layer [b, h, n, n] (None: the layer has no maps, as captured)
Maps = Tensor | Sequence[Tensor | None] | Mapping[int, Tensor | None]


def layer_list(maps: Maps) -> list[Tensor | None]:
    """Normalise the accepted containers to per-layer [b, h, n, n] tensors (None: no maps)."""
    if isinstance(maps, Tensor):
        if maps.dim() != 5:
            raise ValueError(
                f"maps tensor must be [L, b, h, n, n], got shape {tuple(maps.shape)}; "
                "pass a list of per-layer [b, h, n, n] tensors otherwise"
            )
        return list(maps.unbind(0))
    if isinstance(maps, Mapping):
        return [maps[k] for k in sorted(maps)]
    return list(maps)


def batch_shape(layers: list[Tensor | None]) -> tuple[int, int, int]:
    """(b, h, n) shared by every layer that has maps; clear errors otherwise."""
    present = [x for x in layers if x is not None]
    if not present:
        raise ValueError(
            "no layer has attention probabilities (the capture returned None for every "
            "layer: mechanisms such as linear attention never form the n x n map)"
        )
    if present[0].dim() != 4:
        raise ValueError(f"layer maps must be [b, h, n, n], got {tuple(present[0].shape)}")
    b, h, n, m = present[0].shape
    for li, x in enumerate(layers):
        if x is not None and (x.dim() != 4 or x.shape != (b, h, n, m)):
            raise ValueError(
                f"layer {li} maps have shape {tuple(x.shape)}; every layer must be "
                f"[b, h, n, n] = {(b, h, n, m)}"
            )
    if n != m:
        raise ValueError(f"head scores need self-attention maps (n == m), got n={n} m={m}")
    return b, h, n


class HeadScoreAccumulator:
    """Streaming mean of per-example head scores over any number of batches.

    Holds only float64 sums [L, h] and example counts [L] per scorer; ``update`` looks at
    one example and one layer at a time, so memory stays at one batch's captured maps.
    A layer whose maps are None (a mechanism that returns no probabilities) gets NaN.
    """

    def __init__(self, scorers: Sequence[ScorerSpec] = DEFAULT_SCORERS) -> None:
        self.scorers = [build_scorer(s) for s in scorers]
        self.labels = [scorer_label(s) for s in self.scorers]
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"duplicate scorers: {self.labels}")
        self._sums: dict[str, Tensor] = {}  # label -> [L, h] float64
        self._counts: dict[str, Tensor] = {}  # label -> [L] examples in each layer's mean
        self.shape: tuple[int, int] | None = None  # (L, h)
        self.n_examples = 0

    def update(self, maps: Maps, infos: Sequence[TokenInfo] | TokenInfo) -> None:
        layers = layer_list(maps)
        if isinstance(infos, TokenInfo):
            infos = [infos]
        b, h, n = batch_shape(layers)
        if len(infos) != b:
            raise ValueError(f"got {len(infos)} TokenInfo for a batch of {b} examples")
        shape = (len(layers), h)
        if self.shape is None:
            self.shape = shape
            self._sums = {k: torch.zeros(shape, dtype=torch.float64) for k in self.labels}
            self._counts = {k: torch.zeros(shape[0], dtype=torch.long) for k in self.labels}
        elif shape != self.shape:
            raise ValueError(f"maps have (layers, heads) = {shape}, earlier batches {self.shape}")
        for i, info in enumerate(infos):
            if int(info.keep.max()) >= n:
                raise ValueError(
                    f"example {i}: TokenInfo.keep points past the map length {n}; "
                    "build the infos from this batch's input_ids/attention_mask"
                )
            for l, x in enumerate(layers):
                if x is None:
                    continue
                keep = info.keep.to(x.device)
                p = x[i].index_select(-2, keep).index_select(-1, keep)  # [h, n_i, n_i]
                # float64: a share like 9/10 is then the double 0.9 the thresholds compare to
                view = HeadView(p.detach().double().cpu(), info)
                for label, scorer in zip(self.labels, self.scorers, strict=True):
                    val = scorer(view)  # [h], or None: not applicable to this example
                    if val is not None:
                        self._sums[label][l] += val.double()
                        self._counts[label][l] += 1
            self.n_examples += 1

    def counts(self) -> dict[str, list[int]]:
        """label -> examples that entered each layer's mean."""
        return {k: v.tolist() for k, v in self._counts.items()}

    def result(self) -> dict[str, Tensor]:
        """label -> [L, h] float64 mean over examples; NaN where no example applied."""
        if self.shape is None:
            raise ValueError("no maps seen yet: call update() with at least one batch")
        return {  # 0 / 0 -> NaN exactly where a layer saw no applicable example
            k: self._sums[k] / self._counts[k][:, None] for k in self.labels
        }


def score_heads(
    maps: Maps,
    info: Sequence[TokenInfo] | TokenInfo,
    scorers: Sequence[ScorerSpec] = DEFAULT_SCORERS,
) -> dict[str, Tensor]:
    """Scores of one batch: label -> [L, h] averaged over its examples."""
    acc = HeadScoreAccumulator(scorers)
    acc.update(maps, info)
    return acc.result()


# ----------------------------------------------------------------------------- classifier


TIE = 1e-9  # shares this close below a threshold count as reaching it (float rounding)


@dataclass(frozen=True, kw_only=True)
class ClassRule:
    """Thresholds of the project's head classifier (Kovaleva et al. used a CNN on hand labels;
    this is a transparent rule over argmax shares instead).

    Checks, in this order, first match wins:
      1. vertical          f_V >= vertical
      2. diagonal          f_D >= diagonal
      3. vertical+diagonal f_V + f_D >= mixed_total and f_V >= mixed_each and f_D >= mixed_each
      4. block             f_B >= block (f_B is NaN, so never, without pair inputs)
      5. heterogeneous     otherwise
    A head with NaN f_V or f_D (its layer had no maps) is "n/a" (:data:`NO_CLASS`).
    ">=" holds up to :data:`TIE` (1e-9), so a share that is a threshold in exact arithmetic
    (9 of 10 rows = 0.9) reaches it whatever the float rounding of its mean.
    f_V, f_D, f_B are the ``vertical``, ``diagonal`` and ``block`` row shares. A row can count
    for both V and D (row 1 pointing at [CLS] = i-1), so the order is what makes the result
    deterministic; vertical goes first because [CLS]/[SEP] attention is the dominant pattern
    PASTA builds on.
    """

    vertical: float = 0.9  # f_V threshold for "vertical"
    diagonal: float = 0.9  # f_D threshold for "diagonal"
    mixed_total: float = 0.9  # f_V + f_D threshold for "vertical+diagonal"
    mixed_each: float = 0.2  # each of f_V, f_D at least this for "vertical+diagonal"
    block: float = 0.9  # f_B threshold for "block" (pair inputs only)


def classify_shares(
    f_v: Tensor, f_d: Tensor, f_b: Tensor | None = None, rule: ClassRule | None = None
) -> list[list[str]]:
    """[L, h] shares -> class name per head (see :class:`ClassRule` for the order)."""
    rule = rule or ClassRule()
    if f_b is None:
        f_b = torch.full_like(f_v, math.nan)
    if not (f_v.shape == f_d.shape == f_b.shape) or f_v.dim() != 2:
        raise ValueError("f_v, f_d and f_b must be [layers, heads] tables of one shape")
    out: list[list[str]] = []
    for l in range(f_v.shape[0]):
        row = []
        for h in range(f_v.shape[1]):
            v, d, b = float(f_v[l, h]), float(f_d[l, h]), float(f_b[l, h])
            if math.isnan(v) or math.isnan(d):
                row.append(NO_CLASS)
            elif v >= rule.vertical - TIE:
                row.append("vertical")
            elif d >= rule.diagonal - TIE:
                row.append("diagonal")
            elif (v + d >= rule.mixed_total - TIE and v >= rule.mixed_each - TIE
                  and d >= rule.mixed_each - TIE):
                row.append("vertical+diagonal")
            elif b >= rule.block - TIE:  # False for NaN
                row.append("block")
            else:
                row.append("heterogeneous")
        out.append(row)
    return out


def classify_heads(
    scores: Mapping[str, Tensor],
    rule: ClassRule | None = None,
    *,
    vertical: str = "vertical",
    diagonal: str = "diagonal",
    block: str = "block",
) -> list[list[str]]:
    """Classify every head from a score table; ``vertical="vertical_tlm"`` uses TLM's f_V."""
    for key in (vertical, diagonal):
        if key not in scores:
            raise KeyError(
                f"classify_heads needs the {key!r} score; include it in score_heads(scorers=...)"
            )
    return classify_shares(scores[vertical], scores[diagonal], scores.get(block), rule)


def class_names(classes: Sequence[Sequence[str]]) -> list[str]:
    """:data:`HEAD_CLASSES`, plus :data:`NO_CLASS` when a head has it; errors on others."""
    seen = {c for row in classes for c in row}
    bad = seen - {*HEAD_CLASSES, NO_CLASS}
    if bad:
        raise ValueError(f"unknown head class {sorted(bad)[0]!r}; known: {list(HEAD_CLASSES)}")
    return [*HEAD_CLASSES, *([NO_CLASS] if NO_CLASS in seen else [])]


def class_counts(classes: Sequence[Sequence[str]]) -> dict[str, list[int]]:
    """class -> count per layer, over :func:`class_names` in order."""
    return {c: [sum(x == c for x in row) for row in classes] for c in class_names(classes)}


@dataclass
class HeadAnalysis:
    """What :func:`analyze_heads` returns: mean scores, example counts and classes."""

    scores: dict[str, Tensor]  # label -> [L, h]
    counts: dict[str, list[int]]  # label -> examples in each layer's mean
    n_examples: int
    classes: list[list[str]] | None  # None when vertical/diagonal scores were not asked for


def analyze_heads(
    maps: Iterable[Maps] | Iterable[tuple[Maps, Sequence[TokenInfo]]],
    infos: Iterable[Sequence[TokenInfo]] | None = None,
    *,
    scorers: Sequence[ScorerSpec] = DEFAULT_SCORERS,
    rule: ClassRule | None = None,
) -> HeadAnalysis:
    """Streaming head analysis over batches: ``maps`` and ``infos`` run in step, or ``maps``
    yields ``(maps, infos)`` pairs when ``infos`` is None. Each batch's maps are dropped
    after use, so a whole dev set fits in the memory of one batch."""
    acc = HeadScoreAccumulator(scorers)
    pairs: Iterable[tuple[Maps, Sequence[TokenInfo]]]
    if infos is None:  # maps yields (maps, infos) pairs: the signature's second form
        pairs = cast(Iterable[tuple[Maps, Sequence[TokenInfo]]], maps)
    else:  # maps yields maps: the first form
        pairs = zip(cast(Iterable[Maps], maps), infos, strict=True)
    for batch_maps, batch_infos in pairs:
        acc.update(batch_maps, batch_infos)
    scores = acc.result()
    classes = None
    if "vertical" in scores and "diagonal" in scores:
        classes = classify_heads(scores, rule)
    return HeadAnalysis(scores, acc.counts(), acc.n_examples, classes)
