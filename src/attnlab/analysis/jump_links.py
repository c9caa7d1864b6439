"""How dense JAT's jump graph is on a model: the share of (i, j) pairs with a jump link.

Jump Self-attention (``attnlab.mechanisms.jat``) links queries i and j through a key k when

    U_k[i, j] = S[i, k] S[j, k] / (d max(||K_k||_2, 1)) >= rho,     S = Q K^T,

with S the raw per-head scores (no 1/sqrt(d): the mechanism's own ``scores``) and d the head
dim; C[i, j] = sum_k 1[U_k[i, j] >= rho] are the link counts its adjacency A averages over k.
Before training a model with JAT it is worth knowing how many pairs get any link at a given
rho: with none, A is the identity and J only re-weights S.

:func:`jump_link_shares` runs an encoder over tokenized examples, takes each layer's q and k
from forward hooks on its query and key projections (in the BERT layout these are exactly
the tensors the attention function, and so JAT, receives, before the heads are split),
counts links with ``jump_counts`` as ``jat_adjacency`` does, and returns per rho and layer

    share = #{(example, head, i, j) counted : C[i, j] > 0} / #{(example, head, i, j) counted}

pooled over the examples and the chosen heads (a long example weighs n^2 pairs; this is not
a mean of per-example shares). The diagonal i = j is a pair like any other (its count C[i, i],
not A's diagonal, which JAT sets to 1). What is counted depends on ``padding``:

* ``"exclude"`` (default): padding is no key k and no node i or j (``valid`` = the
  attention mask, as JAT with ``mask_pads=True``), and the pairs counted are the real-token
  pairs of each example: sum_examples n_i^2 per head. Independent of how examples are
  batched, up to the encoder's float rounding on padded batches.
* ``"include"``: as JAT with ``mask_pads=False`` (its default, and ``configs/jat/cola.yaml``):
  the padding tokens of a batch are keys and nodes too, and every entry of the padded
  [b, h, n, n] count block is counted. Depends on the batching; this is how the shares once
  quoted in ``docs/results.md`` (one batch of 16 CoLA dev sentences, all heads) were taken.

Shape glossary: b batch, h heads (of the model), s selected heads, n length (queries = keys),
d head dim, r rhos, L layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..hf.arch import Host, inspect_model
from ..mechanisms.jat import jump_counts, key_length

PadMode = Literal["exclude", "include"]
PAD_MODES: tuple[PadMode, ...] = ("exclude", "include")
INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass(frozen=True)
class JumpLinkShares:
    """Link counts per rho and layer, and the pairs they are a share of."""

    rhos: tuple[float, ...]  # thresholds, in the order given
    heads: tuple[int, ...]  # head indices used in every layer
    padding: PadMode  # how padding was treated (module docstring)
    examples: int  # examples read
    pairs: int  # (example, head, i, j) entries counted per layer: the denominator
    linked: Tensor  # [r, L] int64: entries of those with at least one link (C[i, j] > 0)

    @property
    def shares(self) -> Tensor:
        """[r, L] float64: linked / pairs."""
        return self.linked.double() / self.pairs

    def to_dict(self) -> dict[str, Any]:
        return {
            "rhos": list(self.rhos),
            "heads": list(self.heads),
            "padding": self.padding,
            "examples": self.examples,
            "pairs_per_layer": self.pairs,
            "linked": self.linked.tolist(),  # [rho][layer]
            "shares": self.shares.tolist(),  # [rho][layer]
        }


# ------------------------------------------------------------------------------ parsing


def parse_rhos(spec: str) -> list[float]:
    """``"5,10"`` -> [5.0, 10.0] (finite numbers, duplicates dropped, order kept)."""
    out: list[float] = []
    for part in spec.split(","):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"bad --rho entry {part.strip()!r}: expected numbers separated "
                             "by commas, e.g. --rho 5,10") from None
        if not math.isfinite(value):
            raise ValueError(f"--rho must be finite, got {part.strip()!r}")
        if value not in out:
            out.append(value)
    return out


def head_set(spec: str, num_heads: int) -> list[int]:
    """Head indices from ``"all"``, ``"even"`` (0, 2, ...: JAT's heads in the paper's
    recipe), ``"odd"`` or a comma list such as ``"0,3"``, checked against ``num_heads``."""
    key = spec.strip().lower()
    if key in ("all", "even", "odd"):
        start, step = {"all": (0, 1), "even": (0, 2), "odd": (1, 2)}[key]
        return list(range(start, num_heads, step))
    try:
        heads = [int(p) for p in key.split(",")]
    except ValueError:
        raise ValueError(f"bad --heads {spec!r}: expected all, even, odd or 0-based head "
                         "indices separated by commas, e.g. --heads 0,2") from None
    check_heads(heads, num_heads)
    return list(dict.fromkeys(heads))


def check_heads(heads: Sequence[int], num_heads: int) -> None:
    """Error naming the first head index the model does not have (or an empty list)."""
    if not heads:
        raise ValueError("no heads selected; give at least one head index")
    for hd in heads:
        if not 0 <= hd < num_heads:
            raise ValueError(f"head {hd} is out of range: the model has heads 0-{num_heads - 1} "
                             "per layer")


# ------------------------------------------------------------------------------ capture


def _check_host(host: Host) -> None:
    if host.fused:
        raise ValueError(
            f"{host.model_type} has one fused Q/K/V projection (rotary embeddings follow it), "
            "so q and k cannot be read off separate projections; jump links need a model "
            "with separate query and key projections (BERT layout)"
        )
    if host.causal:
        raise ValueError("jump links are defined for bidirectional encoders: JAT mixes every "
                         "position into every score and refuses causal models")


@contextmanager
def projection_taps(host: Host) -> Iterator[dict[tuple[int, str], Tensor]]:
    """While open, every forward stores each layer's query and key projection outputs
    [b, n, h*d] (detached) under (layer, "q") and (layer, "k"); the hooks go on exit."""
    taps: dict[tuple[int, str], Tensor] = {}

    def tap(layer: int, name: str) -> Callable[[nn.Module, Any, Tensor], None]:
        def hook(module: nn.Module, args: Any, output: Tensor) -> None:
            taps[layer, name] = output.detach()
        return hook

    handles = []
    try:
        for layer, attn in enumerate(host.attention):
            for name, proj in (("q", host.proj[0]), ("k", host.proj[1])):
                handles.append(getattr(attn, proj).register_forward_hook(tap(layer, name)))
        yield taps
    finally:
        for handle in handles:
            handle.remove()


def split_heads(x: Tensor, num_heads: int, head_dim: int) -> Tensor:
    """[b, n, h*d] projection output -> [b, h, n, d], as BERT-layout attention splits it."""
    b, n, width = x.shape
    if width != num_heads * head_dim:
        raise ValueError(
            f"a projection gives {width} features, not heads x head dim = {num_heads} x "
            f"{head_dim}; jump links need full-size query and key projections (no multi-query "
            "or re-sized heads)"
        )
    return x.view(b, n, num_heads, head_dim).transpose(1, 2)


# ------------------------------------------------------------------------------ shares


def jump_link_shares(
    model: nn.Module,
    tokenizer: Any,
    features: Sequence[Mapping[str, Sequence[int]]],
    rhos: Sequence[float],
    *,
    heads: Sequence[int] | None = None,
    padding: PadMode = "exclude",
    sign: bool = False,
    batch_size: int = 32,
) -> JumpLinkShares:
    """Share of (i, j) pairs with at least one jump link, per rho and layer.

    model: a Hugging Face encoder with separate query/key projections (BERT layout; a JAT
    plan installed or not: q and k are read before attention). tokenizer: pads each batch.
    features: tokenized examples in order, e.g. ``tokenizer(text, truncation=True,
    max_length=64)`` or ``attnlab.recipes.analyze.load_features``; batches are consecutive
    runs of ``batch_size`` of them. rhos: thresholds (one forward serves all). heads: head
    indices used in every layer (None: all). padding: ``"exclude"`` or ``"include"`` (module
    docstring). sign: JAT's ``sign`` rule (zero U where both scores are negative).

    The counts are ``jump_counts(S, key_length(k), d, rho, sign, valid)`` on S = q k^T [b, s,
    n, n], bit for bit the counts ``jat_adjacency`` computes from the same q and k.
    """
    if padding not in PAD_MODES:
        raise ValueError(f"padding must be 'exclude' or 'include', got {padding!r}")
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    if not rhos:
        raise ValueError("give at least one rho")
    if not all(math.isfinite(r) for r in rhos):
        raise ValueError(f"rho must be finite, got {list(rhos)}")
    if not features:
        raise ValueError("no examples to count jump links on")
    host = inspect_model(model)
    _check_host(host)
    h, d = host.num_heads, host.head_dim
    chosen = list(range(h)) if heads is None else list(dict.fromkeys(heads))
    check_heads(chosen, h)
    device = next(model.parameters()).device
    idx = torch.tensor(chosen, device=device)
    linked = torch.zeros(len(rhos), host.num_layers, dtype=torch.int64)  # [r, L]
    pairs = 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), projection_taps(host) as taps:
            for start in range(0, len(features), batch_size):
                batch = tokenizer.pad(list(features[start:start + batch_size]),
                                      return_tensors="pt")
                inputs = {k: batch[k].to(device) for k in INPUT_KEYS if k in batch}
                model(**inputs)
                mask = inputs["attention_mask"].to(torch.bool)  # [b, n]
                b, n = mask.shape
                if padding == "exclude":
                    valid: Tensor | None = mask[:, None, :]  # [b, 1, n]
                    pairs += len(chosen) * int((mask.sum(-1) ** 2).sum())
                else:
                    valid = None
                    pairs += len(chosen) * b * n * n
                for layer in range(host.num_layers):
                    q = split_heads(taps[layer, "q"], h, d).index_select(1, idx)  # [b, s, n, d]
                    k = split_heads(taps[layer, "k"], h, d).index_select(1, idx)  # [b, s, n, d]
                    scores = q @ k.transpose(-1, -2)  # S [b, s, n, n], raw as in JAT
                    key_len = key_length(k)  # [b, s, n]
                    for r, rho in enumerate(rhos):
                        counts = jump_counts(scores, key_len, d, rho, sign, valid)  # [b,s,n,n]
                        linked[r, layer] += int((counts > 0).sum())
                taps.clear()
    finally:
        model.train(was_training)
    return JumpLinkShares(tuple(float(r) for r in rhos), tuple(chosen), padding,
                          len(features), pairs, linked)
