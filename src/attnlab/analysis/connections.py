"""The JAT connection case study: which entity classes do a head's strongest links join?

Zhou et al., "Jump Self-attention: Capturing High-order Statistics in Transformers",
NeurIPS 2022, appendix E.2: on CoNLL-2003 sentences, count each head's *major connections*
by the entity classes of the two tokens they join, per layer, for the fine-tuned baseline
and for BERT-JAT. This module holds the pure parts (labels, thresholds, counts, figures);
``recipes/connections.py`` runs models over data and writes files.

Definitions (the paper gives the idea, not these details; each choice is written here and in
docs/decisions.md):

- **Token labels are token-level.** Every sub-word token carries its word's entity class,
  the IOB tag with ``B-``/``I-`` stripped: ``PER``, ``ORG``, ``LOC``, ``MISC`` or ``O``. The
  structural special tokens ([CLS]/[SEP], i.e. tokens with no word: ``word_ids`` None) are
  ``SEP``. Padding is cropped before anything is computed, so it never counts. Words cut off
  by ``max_length`` are simply absent.
- **Major connection.** For each (sentence, layer, head) map cropped to the n real tokens,
  entry (i, j) is major when ``p_ij > mean + std`` of that map's n * n entries (strict ``>``;
  population std, ddof=0, since the map is the whole set being described, not a sample).
  The statistics use every entry of the cropped map, diagonal and special tokens included,
  whatever is counted afterwards.
- **Pairs are ordered**: entry (i, j) is query i attending key j, counted once; if j also
  attends i above its threshold that is a second connection. Class labels are symmetric,
  so order changes only how often a pair counts, not its class.
- **The diagonal (i == j) is not counted** by default: a token attending to itself joins no
  two tokens, and counting it would add one same-class "connection" per strongly
  self-attending token, inflating PER/ORG/LOC/MISC/O with nothing about relations between
  tokens (the point of the study). ``include_diagonal=True`` counts it.
- **Pair classes**, first rule that applies: ``SEP`` when either token is SEP; the shared
  class when both tokens have the same class (``O``-``O`` pairs are class ``O``); ``CROSS``
  otherwise (classes differ, ``O`` being a class like the others).
- **entities_only**: tokens labelled ``O`` are dropped altogether, so no pair involving an
  ``O`` token counts (no ``O`` class, no ``SEP``-``O`` pairs; ``CROSS`` then means two
  different entity types). The thresholds are unchanged (still from the full map).

Counts are summed over sentences and heads, one row per layer. ``available`` counts the
candidate pairs of each class (per head, summed over sentences and heads: the same for every
layer), so a count can be read as a rate: how often a pair of that class is a major link.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:  # matplotlib loads only when a figure is drawn
    from matplotlib.figure import Figure

ENTITY_CLASSES: tuple[str, ...] = ("PER", "ORG", "LOC", "MISC")
OUTSIDE = "O"
SEP = "SEP"
CROSS = "CROSS"
TOKEN_CLASSES: tuple[str, ...] = (*ENTITY_CLASSES, OUTSIDE, SEP)
# Column order of every count table; index = pair class id.
PAIR_CLASSES: tuple[str, ...] = (*ENTITY_CLASSES, OUTSIDE, CROSS, SEP)
NOT_COUNTED = -1  # pair id of pairs left out (diagonal, O tokens under entities_only)
# Okabe-Ito hues (colour-blind safe), O and SEP in neutral tones.
CLASS_COLORS: dict[str, str] = {
    "PER": "#0072B2", "ORG": "#E69F00", "LOC": "#009E73", "MISC": "#CC79A7",
    "O": "#BBBBBB", "CROSS": "#D55E00", "SEP": "#555555",
}


# ----------------------------------------------------------------------------- labels


def entity_class(tag: str) -> str:
    """IOB tag -> class: ``B-PER``/``I-PER`` -> ``PER``, ``O`` -> ``O``; errors otherwise."""
    if tag == OUTSIDE:
        return OUTSIDE
    if tag[:2] in ("B-", "I-") and tag[2:] in ENTITY_CLASSES:
        return tag[2:]
    raise ValueError(f"unknown NER tag {tag!r}: expected O or B-/I- with one of "
                     f"{', '.join(ENTITY_CLASSES)}")


def token_classes(word_ids: Sequence[int | None], word_tags: Sequence[str]) -> list[str]:
    """One class per token: its word's entity class, ``SEP`` for tokens of no word.

    ``word_ids`` is the fast tokenizer's map from tokens to words (None for [CLS]/[SEP]),
    ``word_tags`` the sentence's IOB tags, one per word.
    """
    out = []
    for wid in word_ids:
        if wid is None:
            out.append(SEP)
        elif not 0 <= wid < len(word_tags):
            raise ValueError(f"word id {wid} out of range for a sentence of {len(word_tags)} "
                             "words; were word_ids and tags taken from the same sentence?")
        else:
            out.append(entity_class(word_tags[wid]))
    return out


def pair_classes(labels: Sequence[str], *, entities_only: bool = False,
                 include_diagonal: bool = False) -> Tensor:
    """[n, n] long: the PAIR_CLASSES index of each ordered (query i, key j), or NOT_COUNTED."""
    unknown = sorted(set(labels) - set(TOKEN_CLASSES))
    if unknown:
        raise ValueError(f"unknown token classes {unknown}; expected {', '.join(TOKEN_CLASSES)}")
    tok = torch.tensor([TOKEN_CLASSES.index(c) for c in labels], dtype=torch.long)  # [n]
    n = tok.numel()
    ti, tj = tok[:, None].expand(n, n), tok[None, :].expand(n, n)  # [n, n] each
    sep_t = TOKEN_CLASSES.index(SEP)
    pair = torch.full((n, n), PAIR_CLASSES.index(CROSS), dtype=torch.long)
    same = ti == tj  # same token class -> that class (token and pair ids agree for PER..O)
    pair[same] = ti[same]
    pair[(ti == sep_t) | (tj == sep_t)] = PAIR_CLASSES.index(SEP)
    if entities_only:
        o_t = TOKEN_CLASSES.index(OUTSIDE)
        pair[(ti == o_t) | (tj == o_t)] = NOT_COUNTED
    if not include_diagonal:
        pair.fill_diagonal_(NOT_COUNTED)
    return pair


# ----------------------------------------------------------------------------- thresholds


def major_connections(maps: Tensor) -> Tensor:
    """Bool mask of entries above mean + std of their own map: [..., n, m] -> [..., n, m].

    Statistics per map over its n * m entries (population std, strict ``>``), in float64 so
    ties at the threshold are decided the same on every machine.
    """
    if maps.dim() < 2:
        raise ValueError(f"attention maps must be [..., n, m], got shape {tuple(maps.shape)}")
    flat = maps.double().flatten(-2)  # [..., n*m]
    mean = flat.mean(-1, keepdim=True)
    std = flat.std(-1, correction=0, keepdim=True)
    return (flat > mean + std).reshape(maps.shape)


def count_connections(maps: Tensor, labels: Sequence[str], *, entities_only: bool = False,
                      include_diagonal: bool = False) -> Tensor:
    """Major connections of one sentence per class: maps [..., h, n, n] -> [..., C] (int64).

    ``maps`` holds the sentence's maps cropped to its n real tokens (any leading dims, e.g.
    layers); heads are summed, the leading dims kept. C = len(PAIR_CLASSES).
    """
    n = len(labels)
    if maps.dim() < 3 or maps.shape[-2:] != (n, n):
        raise ValueError(f"maps must be [..., heads, {n}, {n}] for {n} token labels, got "
                         f"shape {tuple(maps.shape)}")
    pair = pair_classes(labels, entities_only=entities_only, include_diagonal=include_diagonal)
    per_entry = major_connections(maps).sum(-3)  # [..., n, n]: heads with a major (i, j)
    lead = per_entry.shape[:-2]
    counted = pair >= 0  # [n, n]
    vals = per_entry[..., counted].reshape(math.prod(lead), int(counted.sum()))  # [lead, k]
    idx = pair[counted].expand_as(vals)  # [lead, k]
    out = torch.zeros(vals.shape[0], len(PAIR_CLASSES), dtype=torch.long)
    out.scatter_add_(1, idx, vals.long())
    return out.reshape(*lead, len(PAIR_CLASSES))


def available_pairs(labels: Sequence[str], *, entities_only: bool = False,
                    include_diagonal: bool = False) -> Tensor:
    """[C] int64: how many ordered pairs of each class one map of this sentence offers."""
    pair = pair_classes(labels, entities_only=entities_only, include_diagonal=include_diagonal)
    return torch.bincount(pair[pair >= 0], minlength=len(PAIR_CLASSES))


# ----------------------------------------------------------------------------- streaming


@dataclass
class ConnectionCounts:
    """Summed major connections: ``counts[layer, class]``, columns in PAIR_CLASSES order."""

    counts: Tensor  # [L, C] int64
    available: Tensor  # [C] int64: candidate pairs per head-map, summed over sentences x heads
    n_sentences: int
    n_heads: int
    entities_only: bool
    include_diagonal: bool
    classes: tuple[str, ...] = field(default=PAIR_CLASSES)

    def without_sep(self) -> Tensor:
        """[L, C-1]: the counts with the SEP column dropped (classes_without_sep order)."""
        return self.counts[:, [k for k, c in enumerate(self.classes) if c != SEP]]

    @property
    def classes_without_sep(self) -> tuple[str, ...]:
        return tuple(c for c in self.classes if c != SEP)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per layer: layer, a count per class, total, total_nosep."""
        out = []
        for layer, row in enumerate(self.counts.tolist()):
            r: dict[str, Any] = {"layer": layer, **dict(zip(self.classes, row, strict=True))}
            r["total"] = sum(row)
            r["total_nosep"] = r["total"] - r[SEP]
            out.append(r)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "classes": list(self.classes),
            "counts": self.counts.tolist(),
            "counts_nosep": self.without_sep().tolist(),
            "classes_nosep": list(self.classes_without_sep),
            "totals": dict(zip(self.classes, self.counts.sum(0).tolist(), strict=True)),
            "available_pairs": dict(zip(self.classes, self.available.tolist(), strict=True)),
            # share of each class's candidate pairs that are major, per layer (None: no pairs)
            "rates": [[round(c / a, 6) if a else None
                       for c, a in zip(row, self.available.tolist(), strict=True)]
                      for row in self.counts.tolist()],
            "sentences": self.n_sentences,
            "heads": self.n_heads,
            "entities_only": self.entities_only,
            "include_diagonal": self.include_diagonal,
        }


class ConnectionCounter:
    """Folds batches of captured maps into per-layer class counts (memory: one batch).

    ``update(probs, labels, attention_mask)``: ``probs`` maps layer -> [b, h, n, n] (e.g. an
    ``AttentionCache``), ``labels[i]`` lists the token classes of example i's real tokens,
    in order, and ``attention_mask`` [b, n] marks those tokens (None: no padding).
    """

    def __init__(self, *, entities_only: bool = False, include_diagonal: bool = False) -> None:
        self.entities_only = entities_only
        self.include_diagonal = include_diagonal
        self._counts: Tensor | None = None  # [L, C]
        self._available = torch.zeros(len(PAIR_CLASSES), dtype=torch.long)
        self._layers: list[int] | None = None
        self._heads = 0
        self.n_sentences = 0

    def update(self, probs: Mapping[int, Tensor | None], labels: Sequence[Sequence[str]],
               attention_mask: Tensor | None = None) -> None:
        layers = sorted(probs)
        missing = [layer for layer in layers if probs[layer] is None]
        if missing:
            raise ValueError(f"layers {missing} have no attention probabilities (a mechanism "
                             "that never forms n x n maps); the connection study needs them")
        maps = torch.stack([probs[layer] for layer in layers])  # type: ignore[misc] # [L,b,h,n,n]
        if maps.dim() != 5 or maps.shape[-1] != maps.shape[-2]:
            raise ValueError(f"each layer's maps must be [b, h, n, n], got {tuple(maps.shape[1:])}"
                             " (n x m maps, e.g. prefix tuning's virtual keys, are not "
                             "supported)")
        _, b, h, n, _ = maps.shape
        if self._layers is None:
            self._layers, self._heads = layers, h
            self._counts = torch.zeros(len(layers), len(PAIR_CLASSES), dtype=torch.long)
        elif layers != self._layers or h != self._heads:
            raise ValueError(f"batch has layers {layers} x {h} heads, earlier batches had "
                             f"{self._layers} x {self._heads}")
        if len(labels) != b:
            raise ValueError(f"{len(labels)} label lists for a batch of {b} examples")
        mask = torch.ones(b, n, dtype=torch.bool) if attention_mask is None \
            else attention_mask.bool().cpu()
        if mask.shape != (b, n):
            raise ValueError(f"attention_mask must be [{b}, {n}], got {tuple(mask.shape)}")
        assert self._counts is not None
        for i in range(b):
            keep = mask[i].nonzero().flatten()  # [n_i] real-token positions
            if keep.numel() != len(labels[i]):
                raise ValueError(f"example {i}: {len(labels[i])} token labels for "
                                 f"{keep.numel()} real tokens")
            crop = maps[:, i].index_select(-2, keep).index_select(-1, keep)  # [L, h, n_i, n_i]
            opts = {"entities_only": self.entities_only,
                    "include_diagonal": self.include_diagonal}
            self._counts += count_connections(crop, labels[i], **opts)
            self._available += h * available_pairs(labels[i], **opts)
            self.n_sentences += 1

    def result(self) -> ConnectionCounts:
        if self._counts is None:
            raise ValueError("no batches were counted")
        return ConnectionCounts(self._counts.clone(), self._available.clone(),
                                self.n_sentences, self._heads, self.entities_only,
                                self.include_diagonal)


# ----------------------------------------------------------------------------- figures


def _figure(width: float, height: float) -> Figure:
    # heavy: matplotlib, imported when a figure is drawn (the analysis package loads torch only)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # Agg canvas: no pyplot state, never opens a window
    return fig


def _wrapped(title: str, fig: Figure, fontsize: float) -> str:
    """``title`` broken into lines that fit the figure's width (no title cut at the edges)."""
    chars = max(20, int(fig.get_figwidth() * 72 / (0.6 * fontsize)))  # ~0.6 em per char
    return "\n".join(textwrap.wrap(title, chars))


def _columns(counts: ConnectionCounts, include_sep: bool) -> tuple[list[str], Any]:
    classes = list(counts.classes if include_sep else counts.classes_without_sep)
    table = counts.counts if include_sep else counts.without_sep()
    return classes, table.numpy()


def connection_bars(counts: ConnectionCounts, *, include_sep: bool = True,
                    title: str | None = None) -> Figure:
    """Grouped bars: one group per layer, one bar per pair class (SEP left out if asked)."""
    classes, table = _columns(counts, include_sep)
    n_layers, n_cls = table.shape
    fig = _figure(max(5.0, 0.9 * n_layers + 3.0), 3.6)
    ax = fig.add_subplot()
    width = 0.8 / n_cls
    x = np.arange(n_layers)
    for k, c in enumerate(classes):
        ax.bar(x + (k - (n_cls - 1) / 2) * width, table[:, k], width, label=c,
               color=CLASS_COLORS[c], edgecolor="black", linewidth=0.3)
    ax.set_xticks(x)
    ax.set_xlabel("layer")
    ax.set_ylabel("major connections")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        ax.set_title(_wrapped(title, fig, 12))
    return fig


def compare_connection_bars(a: ConnectionCounts, b: ConnectionCounts, *,
                            labels: tuple[str, str] = ("A", "B"), include_sep: bool = True,
                            title: str | None = None) -> Figure:
    """Two models side by side: one panel per layer, per class a bar for A and one for B."""
    if a.counts.shape != b.counts.shape:
        raise ValueError(f"cannot compare models with {a.counts.shape[0]} and "
                         f"{b.counts.shape[0]} layers")
    classes, ta = _columns(a, include_sep)
    _, tb = _columns(b, include_sep)
    n_layers = ta.shape[0]
    cols = min(3, n_layers)
    rows = -(-n_layers // cols)
    fig = _figure(3.4 * cols + 0.4, 2.6 * rows + 0.8)
    axes = np.atleast_1d(fig.subplots(rows, cols, sharey=True, squeeze=False)).ravel()
    x = np.arange(len(classes))
    for layer, ax in enumerate(axes):
        if layer >= n_layers:
            ax.set_visible(False)
            continue
        ax.bar(x - 0.2, ta[layer], 0.4, label=labels[0], color="#0072B2")
        ax.bar(x + 0.2, tb[layer], 0.4, label=labels[1], color="#E69F00")
        ax.set_xticks(x, labels=classes, fontsize=7, rotation=45)
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncols=2, fontsize=8)
    if title:
        fig.suptitle(_wrapped(title, fig, 12))
    return fig
